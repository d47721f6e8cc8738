"""Application builder: `import_path: deployments.app:build_app` in serve_config.yaml."""
from __future__ import annotations

import os

import ray
from ray.serve import Application

from .config import AppArgs
from .ingress import LookaheadAPI
from .replica import LookaheadModel, LookaheadServer


def check_gpus(num_gpus: float) -> None:
    """A replica asking for GPUs the cluster lacks would wait forever: refuse it now."""
    if num_gpus <= 0:
        return
    available = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else None
    if available is None:
        import torch

        available = torch.cuda.device_count()
    if available < num_gpus:
        raise ValueError(
            f"the model deployment asks for num_gpus={num_gpus} per replica but the Ray cluster has {available} GPU(s); "
            "set `num_gpus: 0` and `model.device: cpu` in the application args to serve on CPU"
        )


def build_app(args: AppArgs) -> Application:
    if isinstance(args, dict):
        args = AppArgs.model_validate(args)
    check_gpus(args.num_gpus)
    if args.num_gpus > 0 and args.model.device == "cpu":
        raise ValueError("num_gpus > 0 but model.device is 'cpu': set model.device to 'cuda'")
    guard = {
        "api_keys": args.auth.resolve_keys(os.environ),  # read where the app is built, once
        "operator_keys": args.auth.resolve_operator_keys(os.environ),
        "open_paths": list(args.auth.open_paths),
        "max_body_bytes": args.limits.max_body_bytes,
    }
    # Keys go to whichever replicas serve the routes; behind a separate ingress, model replicas never see them.
    # Serve runs user code on a second event-loop thread by default; measured here, 4 in 30
    # client disconnects then never reached the replica's generator (the request decoded to
    # its end). On the replica's own loop all 60 of 60 were aborted. The engine has its own
    # thread, so nothing in this replica blocks the loop.
    actor_options = {"num_gpus": args.num_gpus, "num_cpus": args.num_cpus,
                     "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}}
    replica_args = args.model_dump(exclude={"auth"})
    # @serve.deployment makes these Deployments; Ray's decorator typing leaves them classes to mypy.
    if args.http_routes == "model":
        return LookaheadServer.options(ray_actor_options=actor_options).bind(replica_args, guard)  # type: ignore[attr-defined]
    model = LookaheadModel.options(ray_actor_options=actor_options).bind(replica_args)  # type: ignore[attr-defined]
    return LookaheadAPI.bind(model, args.model.served_name, args.engine, args.limits, guard)  # type: ignore[attr-defined]
