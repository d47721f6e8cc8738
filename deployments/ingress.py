"""The separate ingress (`http_routes: ingress`): the routes in a replica of their own, which open
each generation on a model replica through a handle and send it again, whole, to another replica
where the first was lost before the request's first item (clusters, where replicas come and go)."""

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import cast

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from lookahead_core.engine.config import EngineConfig
from lookahead_core.serving import Completion, Delta, RequestError, RequestLimits, ServeRequest

from .bounded_bodies import bounded_bodies
from .routes import Routes, api_app, guard_config

log = logging.getLogger("ray.serve")
OVERLOADED = RequestError(503, "server overloaded: too many queued requests, retry later", code="overloaded",
                          type="overloaded_error")
REPLICA_LOST = RequestError(503, "the model replica serving this request failed; retry", code="replica_failed",
                            type="server_error")
# A replica lost before a request's first token: the request is sent again after these pauses.
# Serve's router keeps routing to a replica on a lost node until the controller has seen it die
# (a node's death takes Ray several health checks), so the pauses span that, not just one check.
RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


# The ingress only awaits I/O: it asks Ray for no CPU, so the model replica can have every core.
@serve.deployment(name="LookaheadAPI", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class LookaheadAPI:
    def __init__(self, model: DeploymentHandle, model_name: str, engine: EngineConfig, limits: RequestLimits,
                 guard: dict | None = None) -> None:
        self.model = model
        self.stream_handle = model.options(stream=True)
        self.routes = Routes(self._open, self._info, model_name)
        self.guard = guard_config(guard)
        self.engine_config = engine
        self.limits = limits

    async def _info(self, detail: bool = True) -> dict:
        return await self.model.info.remote(detail)

    async def _open(self, req: ServeRequest) -> AsyncIterator[Delta | Completion | RequestError]:
        """Start a generation on a model replica and return its items; raises the RequestError of a
        refused request. A replica that dies mid-stream ends the items with a RequestError, so no
        client waits on a request that can no longer finish."""
        for pause in (*RETRY_PAUSES_S, None):
            try:
                # A stream=True handle returns a generator; Ray types .remote() as either kind.
                gen = cast(DeploymentResponseGenerator, self.stream_handle.generate.remote(req))
                first = await gen.__anext__()
                break
            except BackPressureError:
                raise OVERLOADED from None
            except RayError as exc:
                # The replica died or its node is gone (an actor error, a lost node, a crashed
                # worker) and nothing has reached the client yet, so another replica can take the
                # request whole; the pause lets Serve's router learn that the replica is gone.
                if pause is None:
                    raise REPLICA_LOST from None
                log.warning("request %s: replica unreachable before its first item (%s); sent again in %.2f s",
                            req.request_id, type(exc).__name__, pause)
                await asyncio.sleep(pause)
        if isinstance(first, RequestError):
            raise first

        async def items() -> AsyncIterator[Delta | Completion | RequestError]:
            try:
                yield first
                async for item in gen:
                    yield item
            except RayError:
                yield REPLICA_LOST
            finally:
                # Client gone or response abandoned: cancel the replica's generator explicitly
                # rather than rely on Serve propagating the cancellation (a no-op once finished).
                gen.cancel()

        return items()

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this once the replica is constructed. The bodies need the model's vocabulary,
        so this ingress replica is ready once a model replica answers (as its routes would need anyway)."""
        info = await self._info()
        bodies = bounded_bodies(self.routes.model_name, info["vocab_size"], self.engine_config, self.limits)
        return api_app(self.routes, bodies, self.guard)
