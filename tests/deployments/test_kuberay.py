"""configs/kuberay/rayservice.yaml against the `ray.io/v1` RayService schema, as far as it can be
checked offline: the field names, types and required fields of KubeRay's RayService, RayCluster
and head/worker group specs (ray-operator/apis/ray/v1/*_types.go), and of the Kubernetes pod
template fields the manifest uses. Unknown fields are errors, as a typo would be dropped silently
by the API server (or refused under strict field validation)."""
import re

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deployments.config import PROJECT_ROOT

QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Resources(Strict):
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, values: dict[str, str]) -> dict[str, str]:
        for name, q in values.items():
            if not QUANTITY.match(q):
                raise ValueError(f"{name}: {q!r} is not a Kubernetes quantity")
        return values


class ContainerPort(Strict):
    containerPort: int = Field(ge=1, le=65535)
    name: str | None = Field(None, max_length=15)
    protocol: str | None = None


class Container(Strict):
    name: str
    image: str
    command: list[str] | None = None
    args: list[str] | None = None
    env: list[dict] | None = None
    ports: list[ContainerPort] | None = None
    resources: Resources | None = None
    volumeMounts: list[dict] | None = None
    imagePullPolicy: str | None = None


class PodSpec(Strict):
    containers: list[Container] = Field(min_length=1)
    volumes: list[dict] | None = None
    nodeSelector: dict[str, str] | None = None
    tolerations: list[dict] | None = None
    serviceAccountName: str | None = None


class PodTemplateSpec(Strict):
    metadata: dict | None = None
    spec: PodSpec


class HeadGroupSpec(Strict):
    template: PodTemplateSpec
    rayStartParams: dict[str, str]
    serviceType: str | None = None
    headService: dict | None = None
    enableIngress: bool | None = None


class WorkerGroupSpec(Strict):
    groupName: str
    replicas: int | None = Field(None, ge=0)
    minReplicas: int = Field(ge=0)
    maxReplicas: int = Field(ge=0)
    idleTimeoutSeconds: int | None = None
    rayStartParams: dict[str, str]
    template: PodTemplateSpec
    scaleStrategy: dict | None = None
    numOfHosts: int | None = Field(None, ge=1)
    suspend: bool | None = None


class RayClusterSpec(Strict):
    rayVersion: str | None = None
    enableInTreeAutoscaling: bool | None = None
    autoscalerOptions: dict | None = None
    headServiceAnnotations: dict[str, str] | None = None
    gcsFaultToleranceOptions: dict | None = None
    suspend: bool | None = None
    managedBy: str | None = None
    headGroupSpec: HeadGroupSpec
    workerGroupSpecs: list[WorkerGroupSpec] | None = None


class RayServiceSpec(Strict):
    serveConfigV2: str
    rayClusterConfig: RayClusterSpec
    serveService: dict | None = None
    upgradeStrategy: dict | None = None
    excludeHeadPodFromServeSvc: bool | None = None
    rayClusterDeletionDelaySeconds: int | None = None
    # serviceUnhealthySecondThreshold / deploymentUnhealthySecondThreshold: deprecated, unused by
    # KubeRay (kuberay#1685); left out so the manifest does not carry settings that do nothing.


class RayService(Strict):
    apiVersion: str = Field(pattern=r"^ray\.io/v1$")
    kind: str = Field(pattern=r"^RayService$")
    metadata: dict
    spec: RayServiceSpec


def manifest() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "configs" / "kuberay" / "rayservice.yaml").read_text())


def test_manifest_matches_the_rayservice_schema():
    service = RayService.model_validate(manifest())
    cluster = service.spec.rayClusterConfig
    assert cluster.rayVersion == __import__("ray").__version__  # the image runs the Ray we test with
    for group in cluster.workerGroupSpecs:
        assert group.minReplicas <= (group.replicas if group.replicas is not None else group.minReplicas) <= group.maxReplicas


@pytest.mark.parametrize("path, bad, message", [
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0), {"minReplica": 1}, "minReplica"),
    (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams"), {"num-gpus": 0}, "string"),
    (("spec",), {"serviceUnhealthySecondThreshold": 900}, "serviceUnhealthySecondThreshold"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "resources", "limits"),
     {"memory": "64GB"}, "quantity"),
])
def test_the_schema_check_catches_mistakes(path, bad, message):
    doc = manifest()
    node = doc
    for key in path:
        node = node[key]
    node.update(bad)
    with pytest.raises(ValidationError, match=message):
        RayService.model_validate(doc)
