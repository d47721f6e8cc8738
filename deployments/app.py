"""Application builder: `import_path: deployments.app:build_app` in serve_config.yaml."""
from __future__ import annotations

import ray
from ray.serve import Application

from .config import AppArgs
from .ingress import LookaheadAPI
from .model_deployment import LookaheadModel


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
    model = LookaheadModel.options(ray_actor_options={"num_gpus": args.num_gpus, "num_cpus": args.num_cpus}).bind(
        args.model_dump()
    )
    return LookaheadAPI.bind(model, args.model.served_name)
