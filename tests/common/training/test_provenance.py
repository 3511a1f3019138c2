"""What provenance.json records about the run."""

from __future__ import annotations

import json

from common.training.provenance import code_version, environment, write_json


def test_environment_and_json(tmp_path):
    env = environment("cpu")
    assert env["device"] == "cpu" and "torch" in env["libraries"] and env["python"]
    assert env["code_version"] is None or len(env["code_version"].split("-")[0]) == 40
    assert code_version() == env["code_version"]
    path = write_json(tmp_path / "p.json", {"environment": env, "path": tmp_path})
    assert json.loads(path.read_text())["environment"] == json.loads(json.dumps(env))
