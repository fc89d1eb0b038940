"""The Kubernetes manifests in deploy/k8s: schema, wiring, and the commands their containers run.

No cluster runs here. Every object is validated against the Kubernetes v1.33 JSON schema (strict:
an unknown or misspelt field fails) vendored in tests/k8s-schema.json: the definitions that Pod,
Deployment, Service, ConfigMap and HorizontalPodAutoscaler (autoscaling/v2) reference, taken from the PyPI package kubernetes-validate
1.37.0 (``kubernetes-json-schema/v1.33.0-local-strict/_definitions.json``, sha256 c6ac7ea7...1cd3)
with their descriptions removed; Apache-2.0, see tests/k8s-schema.LICENSE. Then what the schema
cannot say is checked (mounts name volumes that exist, probes hit declared ports, /dev/shm is a
memory-backed emptyDir in every container, the headless Service selects the Deployment's pods,
the ConfigMap holds a valid server config whose datasets lie on read-only mounts), and the
sidecar's command line is run on this machine (container paths mapped to temporary folders),
probed the way the kubelet probes it (gRPC health) and read from the way the trainer reads.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import subprocess

import pytest
import yaml

from deployed import Mapping, running
from test_deploy import FMNIST_DIR, FMNIST_FILES, batchd_exe, run_batchd

REPO = pathlib.Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SCHEMA = REPO / "tests" / "k8s-schema.json"
KINDS = {
    ("v1", "Pod"): "io.k8s.api.core.v1.Pod",
    ("apps/v1", "Deployment"): "io.k8s.api.apps.v1.Deployment",
    ("v1", "Service"): "io.k8s.api.core.v1.Service",
    ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "io.k8s.api.autoscaling.v2.HorizontalPodAutoscaler",
}

pytestmark = pytest.mark.timeout(120)


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def objects(kind: str) -> list[dict]:
    return [d for _, d in documents() if d.get("kind") == kind]


def one(kind: str, name: str | None = None) -> dict:
    found = [d for d in objects(kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs() -> dict[str, dict]:
    """Every pod spec: the Pods' and the Deployments' templates."""
    specs = {f"Pod {p['metadata']['name']}": p["spec"] for p in objects("Pod")}
    specs.update({f"Deployment {d['metadata']['name']}": d["spec"]["template"]["spec"] for d in objects("Deployment")})
    return specs


def all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def container(spec: dict, name: str) -> dict:
    return next(c for c in all_containers(spec) if c["name"] == name)


def argv_of(c: dict) -> list[str]:
    """What the container runs: command (else the image's ENTRYPOINT, `batchd` for batchd's image) + args."""
    if "command" in c:
        return list(c["command"]) + list(c.get("args", []))
    return ["batchd"] + list(c.get("args", []))


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]


def mounts(c: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def volumes(spec: dict) -> dict[str, dict]:
    return {v["name"]: v for v in spec.get("volumes", [])}


def server_containers() -> list[tuple[str, dict, dict]]:
    return [(where, spec, c) for where, spec in pod_specs().items() for c in all_containers(spec)
            if argv_of(c)[:2] == ["batchd", "serve"]]


# ---- schema ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)

    def validate(doc: dict) -> list[str]:
        ref = KINDS.get((doc.get("apiVersion"), doc.get("kind")))
        assert ref is not None, f"no schema for {doc.get('apiVersion')} {doc.get('kind')}"
        v = cls({**schema, "$ref": f"#/$defs/{ref}"})
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]

    return validate


def test_manifests_exist():
    names = {p.name for p in K8S.glob("*.yaml")}
    assert {"sidecar-pod.yaml", "batchd-deployment.yaml", "batchd-service.yaml", "configmap.yaml", "batchd-hpa.yaml",
            "prometheus-adapter-rules.yaml"} <= names
    assert {(d["kind"], d["metadata"]["name"]) for _, d in documents()} >= {
        ("Pod", "fashion-mnist-trainer"), ("Pod", "fashion-mnist-trainer-pool"), ("Deployment", "batchd"), ("Service", "batchd"), ("ConfigMap", "batchd-config"),
        ("HorizontalPodAutoscaler", "batchd"), ("ConfigMap", "batchd-prometheus-adapter")}


def test_every_object_validates_against_the_kubernetes_schema(validator):
    for name, doc in documents():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{name}: apiVersion, kind and metadata are required"
        assert doc["metadata"].get("name"), f"{name}: metadata.name is required"
        errors = validator(doc)
        assert not errors, f"{name} ({doc['kind']}):\n" + "\n".join(errors)


def test_the_schema_catches_typos_and_wrong_types(validator):
    pod = one("Pod", "fashion-mnist-trainer")
    typo = copy.deepcopy(pod)
    typo["spec"]["volumes"][0]["emptyDirr"] = typo["spec"]["volumes"][0].pop("emptyDir")
    assert validator(typo), "a misspelt field must not validate"
    wrong = copy.deepcopy(pod)
    container(wrong["spec"], "batchd")["ports"][0]["containerPort"] = "fifty"
    assert validator(wrong), "a port must be an integer"
    deployment = copy.deepcopy(one("Deployment"))
    deployment["spec"]["replicas"] = "three"
    assert validator(deployment)


# ---- wiring -----------------------------------------------------------------------------------------


def test_mounts_name_volumes_that_exist_and_probes_hit_declared_ports():
    for where, spec in pod_specs().items():
        vols = volumes(spec)
        used = set()
        for c in all_containers(spec):
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{where}/{c['name']}: mounts volume {m['name']!r}, which the pod lacks"
                used.add(m["name"])
            ports = {p["containerPort"] for p in c.get("ports", [])} | {p.get("name") for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c:
                    continue
                action = c[probe]
                assert "grpc" in action, f"{where}/{c['name']}: {probe} should be a gRPC health probe"
                assert action["grpc"]["port"] in ports, f"{where}/{c['name']}: {probe} port is not a container port"
                listening = [a for a in option(argv_of(c), "--address") if not a.startswith("unix:")]
                assert f"0.0.0.0:{action['grpc']['port']}" in listening, (
                    f"{where}/{c['name']}: the kubelet probes the pod IP; batchd must listen on 0.0.0.0:PORT")
        assert used == set(vols), f"{where}: volumes nobody mounts: {set(vols) - used}"


def test_dev_shm_is_a_sized_memory_backed_emptydir_in_every_container():
    for where, spec in pod_specs().items():
        vols = volumes(spec)
        for c in all_containers(spec):
            m = mounts(c).get("/dev/shm")
            assert m is not None, f"{where}/{c['name']}: no volume at /dev/shm (the runtime default is 64 MB)"
            empty = vols[m["name"]].get("emptyDir")
            assert empty is not None and empty.get("medium") == "Memory", f"{where}: /dev/shm must be emptyDir Memory"
            assert empty.get("sizeLimit"), f"{where}: size /dev/shm deliberately (sizeLimit)"


def test_sidecar_pod_shares_a_socket_and_starts_batchd_first():
    spec = one("Pod", "fashion-mnist-trainer")["spec"]
    server, trainer = container(spec, "batchd"), container(spec, "trainer")
    # native sidecar: an init container that keeps running, started (probe passing) before the trainer
    assert server in spec.get("initContainers", []) and server.get("restartPolicy") == "Always"
    assert "startupProbe" in server and "readinessProbe" in server and "livenessProbe" in server
    socket_address = next(a for a in option(argv_of(server), "--address") if a.startswith("unix:"))
    socket_dir = str(pathlib.PurePosixPath(socket_address[len("unix:"):]).parent)
    s_mount, t_mount = mounts(server).get(socket_dir), mounts(trainer).get(socket_dir)
    assert s_mount and t_mount and s_mount["name"] == t_mount["name"], "the socket's folder must be one shared volume"
    assert "emptyDir" in volumes(spec)[s_mount["name"]]
    assert mounts(server)["/dev/shm"]["name"] == mounts(trainer)["/dev/shm"]["name"]
    targv = argv_of(trainer)
    assert option(targv, "--address") == [socket_address]
    assert option(targv, "--transport") == ["shm"]
    # one user for both: the socket is created 0600 for it
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True


def test_sidecar_pool_pod_reads_its_sidecar_and_every_replica_of_the_pool():
    """docs/several-servers.md's deployment: the trainer names its sidecar's socket (shared memory)
    and the headless Service's DNS name (every ready replica of the Deployment, over TCP) in one
    loader, transport "auto"; the sidecar is sidecar-pod.yaml's, the same image and config as the
    pool's (the same bytes)."""
    spec = one("Pod", "fashion-mnist-trainer-pool")["spec"]
    server, trainer = container(spec, "batchd"), container(spec, "trainer")
    assert server in spec.get("initContainers", []) and server.get("restartPolicy") == "Always"
    assert mounts(server)["/dev/shm"]["name"] == mounts(trainer)["/dev/shm"]["name"]
    socket_address = next(a for a in option(argv_of(server), "--address") if a.startswith("unix:"))
    service, deployment = one("Service", "batchd"), one("Deployment", "batchd")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    targv = argv_of(trainer)
    assert option(targv, "--address") == [socket_address, f"dns:///batchd.default.svc.cluster.local:{port}"]
    assert option(targv, "--transport") == ["auto"]
    pool = container(deployment["spec"]["template"]["spec"], "batchd")
    assert server["image"] == pool["image"]
    assert option(argv_of(server), "--config") == option(argv_of(pool), "--config")
    plain = one("Pod", "fashion-mnist-trainer")["spec"]
    assert container(plain, "batchd") == server and volumes(plain) == volumes(spec)


def test_headless_service_selects_the_deployment():
    deployment, service = one("Deployment", "batchd"), one("Service", "batchd")
    assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns the replica count (batchd-hpa.yaml)"
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), "the Deployment's selector must match its own pods"
    assert service["spec"]["clusterIP"] == "None", "headless: DNS must answer with every pod's IP"
    assert service["spec"]["selector"].items() <= labels.items(), "the Service must select the Deployment's pods"
    c = container(deployment["spec"]["template"]["spec"], "batchd")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = {}
    for p in service["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        assert target in ports or target in ports.values(), f"Service port {p} targets no container port"
        assert ports.get(target, target) == p["port"]
        served[p["name"]] = p["port"]
    # the gRPC port, and the data plane's (docs/network.md): the port the config gives it, the
    # gRPC port + 1 (the server's default)
    config = yaml.safe_load(one("ConfigMap", "batchd-config")["data"]["config.yaml"])
    assert served == {"grpc": 50051, "data": config["data_plane"]["port"]} == {"grpc": 50051, "data": 50051 + 1}


def test_every_server_listening_on_tcp_declares_its_data_port():
    """A server container with a TCP address has its data plane beside it, on the config's port
    (the gRPC port + 1): the container names it ``data`` (what a NetworkPolicy or a Service
    targets), next to ``grpc`` on the port it listens on."""
    config = yaml.safe_load(one("ConfigMap", "batchd-config")["data"]["config.yaml"])
    for where, _, c in server_containers():
        tcp = [a for a in option(argv_of(c), "--address") if not a.startswith("unix:")]
        assert tcp, f"{where}: no TCP address (the kubelet's probes need one)"
        grpc_port = int(tcp[0].rsplit(":", 1)[1])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports.get("grpc") == grpc_port, f"{where}: {ports}"
        assert ports.get("data") == config["data_plane"]["port"] == grpc_port + 1, f"{where}: {ports}"


def test_config_map_is_a_valid_config_on_read_only_mounts(tmp_path):
    from batchd.server.config import load_config

    cm = one("ConfigMap", "batchd-config")
    for where, spec, c in server_containers():
        config_path = option(argv_of(c), "--config")[0]
        folder, key = str(pathlib.PurePosixPath(config_path).parent), pathlib.PurePosixPath(config_path).name
        m = mounts(c).get(folder)
        assert m is not None and m.get("readOnly") is True, f"{where}: mount the config read-only at {folder}"
        vol = volumes(spec)[m["name"]]
        assert vol.get("configMap", {}).get("name") == cm["metadata"]["name"]
        assert key in cm["data"], f"{where}: the ConfigMap has no key {key}"
        (tmp_path / key).write_text(cm["data"][key])
        config = load_config(tmp_path / key)
        for name, ds in config.datasets.items():
            root = str(getattr(ds, "root", None) or ds.path)
            inside = [t for t in mounts(c) if root.startswith(t.rstrip("/") + "/")]
            assert inside, f"{where}: dataset {name} ({root}) is on no volume"
            for t in inside:
                assert mounts(c)[t].get("readOnly") is True, f"{where}: mount the datasets read-only"
                pvc = volumes(spec)[mounts(c)[t]["name"]].get("persistentVolumeClaim")
                assert pvc is None or pvc.get("readOnly") is True
        cache = str(config.cache_dir)
        assert any(cache == t or cache.startswith(t + "/") for t in mounts(c)), f"{where}: cache_dir is on no volume"
        # the pipeline preset is the example's
        example = load_config(REPO / "examples" / "fashion_mnist.yaml")
        assert config.pipelines == example.pipelines


def test_containers_call_batchd_options_that_exist():
    calls = [(where, argv_of(c)) for where, _, c in server_containers()]
    assert len(calls) == 3  # the two sidecars and the Deployment's server
    helps: dict[str, str] = {}
    for where, argv in calls:
        sub = argv[1]
        if sub not in helps:
            res = run_batchd(sub, "--help")
            assert res.returncode == 0, res.stderr
            helps[sub] = res.stdout
        for opt in (a for a in argv[2:] if a.startswith("--")):
            assert opt in helps[sub], f"{where}: `batchd {sub}` has no option {opt}"


# ---- what the sidecar runs, run here ----------------------------------------------------------------


def test_sidecar_command_serves_the_socket_and_the_probe_port(tmp_path):
    missing = [f for f in FMNIST_FILES if not (FMNIST_DIR / f).is_file()]
    if missing:
        pytest.skip(f"Fashion-MNIST is not in {FMNIST_DIR} (apt-get install dataset-fashion-mnist)")
    import batchd

    spec = one("Pod", "fashion-mnist-trainer")["spec"]
    server, trainer = container(spec, "batchd"), container(spec, "trainer")
    cm = one("ConfigMap", "batchd-config")
    (tmp_path / "etc").mkdir()
    mapping = Mapping({"/etc/batchd": str(tmp_path / "etc"), "/run/batchd": str(tmp_path / "run"),
                       "/var/cache/batchd": str(tmp_path / "cache"), "/usr/share/datasets": str(FMNIST_DIR.parent)})
    # the data plane's fixed port, as the gRPC port, becomes a free one here
    config_text = re.sub(r"(data_plane: \{port: )(\d+)\}", lambda m: f"{m.group(1)}{mapping.port(m.group(2))}}}",
                         mapping.text(cm["data"]["config.yaml"]))
    assert config_text != mapping.text(cm["data"]["config.yaml"]), "the config's data_plane port was not mapped"
    (tmp_path / "etc" / "config.yaml").write_text(config_text)
    argv = [mapping.arg(a) for a in argv_of(server)]
    argv[0] = batchd_exe()
    with running(argv, cwd=tmp_path) as (proc, log):
        socket_address = mapping.arg(option(argv_of(server), "--address")[0])
        assert socket_address.startswith("unix:") and pathlib.Path(socket_address[5:]).is_socket()
        assert re.search(rf"listening on {re.escape(socket_address)} .*also on 127\.0\.0\.1:\d+", "".join(log)), log
        # the kubelet's gRPC probe: grpc.health.v1 Check(service="") on the probe port
        port = mapping.port(server["readinessProbe"]["grpc"]["port"])
        res = run_batchd("health", f"127.0.0.1:{port}", "--timeout", "5")
        assert res.returncode == 0 and "SERVING" in res.stdout, res.stdout + res.stderr
        # the exec alternative, over the socket
        res = run_batchd("health", socket_address, "--timeout", "5")
        assert res.returncode == 0, res.stdout + res.stderr
        # the trainer's address and transport
        address = mapping.arg(option(argv_of(trainer), "--address")[0])
        transport = option(argv_of(trainer), "--transport")[0]
        with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=500, transform="train",
                                     transport=transport) as ld:
            batches = [b["index"].numpy().copy() for b in ld]
        assert sum(len(b) for b in batches) == 10_000
        proc.terminate()
        assert proc.wait(20) == 0, "".join(log)
    assert subprocess.run([batchd_exe(), "health", socket_address, "--timeout", "2"],
                          capture_output=True).returncode != 0
