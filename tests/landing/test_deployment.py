"""The front door's deployment: compose and Kubernetes run a 3-node NATS
JetStream cluster that requires credentials and `pipeline serve` with a
readiness probe; rollout gets the log's address and the credentials."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _k8s(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "infra" / "k8s" / name).read_text()) if d]


def test_kubernetes_runs_a_three_node_jetstream_cluster_with_auth():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s("front-door.yaml")}
    sts = docs[("StatefulSet", "nats")]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "nats"
    conf = docs[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    assert "jetstream" in conf and "authorization" in conf
    assert all(f"nats-{i}.nats:6222" in conf for i in range(3))
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"] for e in c["env"]} >= {"NATS_USER", "NATS_PASSWORD"} and c["readinessProbe"]
    assert docs[("Service", "nats")]["spec"]["clusterIP"] == "None"


def test_kubernetes_runs_serve_with_a_readiness_probe_and_rollout_publishes_to_it():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s("front-door.yaml")}
    dep = docs[("Deployment", "pipeline-serve")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "serve" and "--ready-file" in c["args"] and "--replicas" in c["args"]
    ready = c["args"][c["args"].index("--ready-file") + 1]
    assert ready in " ".join(c["readinessProbe"]["exec"]["command"])
    assert {"name": "nats-auth"} in [e.get("secretRef") for e in c["envFrom"]]
    lake_env = _k8s("configmap.yaml")[0]["data"]
    assert lake_env["PIPELINE_INGEST_URL"] == "nats://nats:4222"
    rollout = next(d for d in _k8s("cronjobs.yaml") if "rollout" in d["metadata"]["name"])
    pod = rollout["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    names = [e["secretRef"]["name"] for c in pod["containers"] for e in c["envFrom"] if "secretRef" in e]
    assert "nats-auth" in names


def test_compose_runs_the_cluster_and_serve():
    doc = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    svc = doc["services"]
    nats = [n for n in svc if n.startswith("nats-")]
    assert len(nats) == 3
    for n in nats:
        cmd = svc[n]["command"]
        assert "-js" in cmd and "--user" in cmd and "--routes" in cmd
        assert len(cmd[cmd.index("--routes") + 1].split(",")) == 2
    assert svc["serve"]["command"][0] == "serve" and "healthcheck" in svc["serve"]
    assert svc["scheduler"]["environment"]["PIPELINE_INGEST_URL"].startswith("nats://")
