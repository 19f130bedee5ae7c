"""infra/ manifests agree with each other, with the job config schema and with pyproject pins.

Parsed, not rendered: KubeRay RayCluster / RayJob / RayCronJob, the cluster launcher YAML,
the Dockerfile, and infra/job.yaml (validated by `vlbatch.pipeline.config.load_config`).
"""
from __future__ import annotations

import copy
import re
import shlex
import tomllib

import pytest
import yaml
from test_jobs_support import REPO

from vlbatch.pipeline.config import load_config

INFRA = REPO / "infra"


def _yaml(rel: str) -> dict:
    return yaml.safe_load((INFRA / rel).read_text())


def _pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    pins = {}
    for d in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^,;]+)", d.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def _groups(spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def job():
    return load_config(INFRA / "job.yaml")


@pytest.fixture(scope="module")
def cluster():
    return _yaml("kuberay/raycluster.yaml")


def test_raycluster_shape_fits_the_job(cluster, job):
    check_cluster_fits_job(cluster, job)


@pytest.mark.parametrize("override", [
    "resources.model.max_actors=9",  # more model actors than GPU pods
    "resources.model.num_gpus=3",  # a model actor needs more GPUs than a pod has
    "resources.model.num_cpus=12",  # ... or more CPUs
    "resources.decode.max_actors=200",  # CPU pools at their maximum overflow the CPU group
    "resources.preprocess.num_cpus=17",
])
def test_the_fit_check_catches_a_job_too_big_for_the_cluster(cluster, override):
    with pytest.raises(AssertionError):
        check_cluster_fits_job(cluster, load_config(INFRA / "job.yaml", [override]))


def check_cluster_fits_job(cluster: dict, job) -> None:
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["rayVersion"] == _pins()["ray"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no work on the head
    groups = _groups(spec)
    cpu, gpu = groups["cpu-workers"], groups["gpu-workers"]
    res = job.resources

    # GPU group: scales from zero; Ray's GPU count equals the pod's nvidia.com/gpu limit.
    gpus = int(gpu["rayStartParams"]["num-gpus"])
    limits = _container(gpu)["resources"]["limits"]
    assert gpu["minReplicas"] == 0 and gpus == int(limits["nvidia.com/gpu"])
    assert int(gpu["rayStartParams"]["num-cpus"]) == int(limits["cpu"])
    assert res.model.num_gpus > 0 and gpus % res.model.num_gpus == 0
    actors_per_gpu_pod = min(gpus / res.model.num_gpus, int(limits["cpu"]) // res.model.num_cpus)
    assert actors_per_gpu_pod >= 1, "a model actor must fit on one GPU pod"
    assert res.model.max_actors <= gpu["maxReplicas"] * actors_per_gpu_pod, "max model actors must fit the group"
    if res.model.memory_gb:
        assert res.model.memory_gb * actors_per_gpu_pod <= _gib(limits["memory"])

    # CPU group: decode / preprocess / write actors; none needs a GPU.
    cpus = int(cpu["rayStartParams"]["num-cpus"])
    assert "num-gpus" not in cpu["rayStartParams"] and "nvidia.com/gpu" not in _container(cpu)["resources"]["limits"]
    assert cpus == int(_container(cpu)["resources"]["limits"]["cpu"])
    cpu_stages = (res.decode, res.preprocess, res.write)
    assert all(s.num_cpus <= cpus for s in cpu_stages)
    peak = sum(s.max_actors * s.num_cpus for s in cpu_stages)
    assert peak <= cpu["maxReplicas"] * cpus, "CPU actor pools at their maximum must fit the CPU group"
    floor = sum(s.min_actors * s.num_cpus for s in cpu_stages)
    assert floor <= max(cpu["minReplicas"], 1) * cpus


def _gib(q: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Gi|Mi)", q)
    assert m, q
    return float(m.group(1)) / (1024 if m.group(2) == "Mi" else 1)


CONFIG_MOUNT = "/etc/vlbatch"


def split_config_mount(cluster_spec: dict) -> tuple[dict, dict, dict]:
    """A RayJob's cluster spec -> (the spec less the job-config volume and its head mount,
    the volume, the mount). The volume is the head pod's only one, a ConfigMap."""
    spec = copy.deepcopy(cluster_spec)
    pod = spec["headGroupSpec"]["template"]["spec"]
    (volume,) = pod.pop("volumes")
    (head,) = pod["containers"]
    (mount,) = head.pop("volumeMounts")
    return spec, volume, mount


@pytest.mark.parametrize("rel,path", [("kuberay/rayjob.yaml", ("spec",)),
                                      ("kuberay/raycronjob.yaml", ("spec", "jobTemplate"))])
def test_rayjob_and_cronjob_run_our_cli_on_the_same_cluster(rel, path, cluster, job):
    doc = _yaml(rel)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == ("RayJob" if "cron" not in rel else "RayCronJob")
    spec = doc
    for key in path:
        spec = spec[key]
    bare, _, _ = split_config_mount(spec["rayClusterSpec"])
    assert bare == cluster["spec"], "same cluster shape as raycluster.yaml, plus the job config's mount"
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] >= 1
    argv = shlex.split(spec["entrypoint"])
    assert argv[:4] == ["python", "-m", "vlbatch.jobs.cli", "run"]
    if "cron" in rel:
        from vlbatch.jobs.scheduling import parse_cron

        schedule = doc["spec"]["schedule"]
        parse_cron(schedule)
        assert argv[argv.index("--schedule") + 1] == schedule, "the run's slot follows the cron schedule"
        assert spec["activeDeadlineSeconds"] < 24 * 3600, "one night's run ends before the next starts"


@pytest.mark.parametrize("rel,path", [("kuberay/rayjob.yaml", ("spec",)),
                                      ("kuberay/raycronjob.yaml", ("spec", "jobTemplate"))])
def test_rayjob_and_cronjob_read_the_job_config_from_a_configmap(rel, path, tmp_path):
    """The entrypoint's config is the `job.yaml` key of a ConfigMap mounted on the head (where the
    driver runs), not a file baked into the image; the manifest's header names the command that
    creates that ConfigMap, and a config mounted that way (a ConfigMap volume: the key a symlink
    into ..data/) loads."""
    doc = _yaml(rel)
    spec = doc
    for key in path:
        spec = spec[key]
    _, volume, mount = split_config_mount(spec["rayClusterSpec"])
    assert mount["name"] == volume["name"] and mount["mountPath"] == CONFIG_MOUNT and mount["readOnly"] is True
    name = volume["configMap"]["name"]
    config_path = shlex.split(spec["entrypoint"])[4]
    assert config_path == f"{CONFIG_MOUNT}/job.yaml", "the ConfigMap's job.yaml, not the image's /app/infra/job.yaml"
    header = (INFRA / rel).read_text().split("apiVersion:")[0]
    m = re.search(r"kubectl create configmap (\S+) --from-file=job\.yaml=(\S+)", header)
    assert m and m.group(1) == name, "the documented command creates the mounted ConfigMap"
    assert (REPO / m.group(2)).is_file(), "the documented config exists"
    # the layout kubelet gives a ConfigMap volume: <mount>/job.yaml -> ..data/job.yaml
    data = tmp_path / "..2026_12_02" / "job.yaml"
    data.parent.mkdir()
    data.write_text((REPO / m.group(2)).read_text())
    (tmp_path / "..data").symlink_to(data.parent.name)
    (tmp_path / "job.yaml").symlink_to("..data/job.yaml")
    assert load_config(tmp_path / "job.yaml") == load_config(REPO / m.group(2))


def test_cluster_launcher_matches_kuberay(cluster):
    launcher = _yaml("cluster-launcher.yaml")
    types = launcher["available_node_types"]
    assert types[launcher["head_node_type"]]["resources"] == {"CPU": 0}
    groups = _groups(cluster["spec"])
    gpu_t, cpu_t = types["gpu_workers"], types["cpu_workers"]
    assert gpu_t["resources"] == {"CPU": int(groups["gpu-workers"]["rayStartParams"]["num-cpus"]),
                                  "GPU": int(groups["gpu-workers"]["rayStartParams"]["num-gpus"])}
    assert cpu_t["resources"] == {"CPU": int(groups["cpu-workers"]["rayStartParams"]["num-cpus"])}
    assert gpu_t["min_workers"] == 0 and gpu_t["max_workers"] == groups["gpu-workers"]["maxReplicas"]
    assert cpu_t["max_workers"] == groups["cpu-workers"]["maxReplicas"]
    assert launcher["max_workers"] >= gpu_t["max_workers"] + cpu_t["max_workers"]
    assert any("--num-cpus=0" in c for c in launcher["head_start_ray_commands"])


def test_one_image_everywhere_with_pyproject_pins(cluster):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    image = f"ghcr.io/vlbatch/vlbatch:{version}"
    images = [c["image"] for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]]
    images += [_container(g)["image"] for g in cluster["spec"]["workerGroupSpecs"]]
    images.append(_yaml("cluster-launcher.yaml")["docker"]["image"])
    assert set(images) == {image}

    docker = (INFRA / "Dockerfile").read_text()
    base = re.search(r"^FROM python:(\d+\.\d+)", docker, re.M)
    assert base and base.group(1) == "3.11"
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^"]+)"', docker))
    pins = _pins()
    assert pinned, "the Dockerfile pins its heavy dependencies"
    for name, ver in pinned.items():
        assert pins.get(name.lower()) == ver, f"{name}: Dockerfile {ver} vs pyproject {pins.get(name.lower())}"
    for must in ("torch", "ray", "transformers"):
        assert must in pinned
    assert "ray[data,default]" in docker, "the image needs the Jobs API (ray[default])"


def _pod_containers(doc: dict) -> list[dict]:
    """Every container of every pod template in a KubeRay document, wherever it sits."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node and isinstance(node["containers"], list):
                found.extend(node["containers"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    return found


@pytest.mark.parametrize("rel", ["kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "kuberay/raycronjob.yaml"])
def test_every_pod_reads_the_optional_storage_secret(rel):
    """Issue 50: object-storage credentials reach every pod (driver on the head, readers and writers on the
    workers) from one optional Secret; without it the AWS chain (IRSA, instance role) is used."""
    containers = _pod_containers(_yaml(rel))
    assert len(containers) >= 3
    for c in containers:
        assert {"secretRef": {"name": "vlbatch-storage", "optional": True}} in c.get("envFrom", []), (rel, c["name"])
