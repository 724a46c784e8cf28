"""A wheel carries what the CLI needs: installed without the source tree, it finds its configs."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def _run(*cmd, cwd, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_install_in_a_fresh_venv_runs_stages_from_its_packaged_configs(tmp_path):
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", wheels, REPO, cwd=tmp_path)
    wheel = next(wheels.glob("orchestrator-*.whl"))
    # The dependencies (torch, hydra, ...) come from this interpreter's site-packages; the
    # project itself only from the wheel (the venv's own site-packages come first).
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    work = tmp_path / "elsewhere"  # no source tree in the working directory
    work.mkdir()

    where = _run(python, "-c", "import orchestrator, json; print(json.dumps(orchestrator.__file__))",
                 cwd=work).stdout
    assert json.loads(where).startswith(str(venv)), where

    cfg = _run(python, "-m", "orchestrator", "--cfg", "job", "cluster=dgx_h100", cwd=work).stdout
    assert "intra_busbw_GBps: 450.0" in cfg  # conf/cluster/dgx_h100.yaml, from the wheel

    # The repository's example site (top-level conf/) is not in the wheel; a user's site folder
    # (./conf) is layered over the wheel's configs.
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "orchestrator/conf/cluster/local.yaml" in names
    assert not [n for n in names if n.startswith("conf/") or "example_site" in n], names
    (work / "conf" / "cluster").mkdir(parents=True)
    (work / "conf" / "cluster" / "mysite.yaml").write_text("name: mysite\ntasks_per_node: 3\n")
    cfg = _run(python, "-m", "orchestrator", "--cfg", "job", "cluster=mysite", "model=llama2_7b",
               cwd=work).stdout
    assert "name: mysite" in cfg and "tasks_per_node: 3" in cfg and "name: llama2_7b" in cfg

    profiles = work / "profiles"
    _run(python, "-m", "orchestrator", "stage=profile_hardware", "profile_hardware.source=analytic",
         "cluster=dgx_h100", f"profiles_dir={profiles}", cwd=work)
    _run(python, "-m", "orchestrator", "stage=profile_model", "profile_model.source=analytic",
         "cluster=dgx_h100", "model=tiny", f"profiles_dir={profiles}", cwd=work)
    model = json.loads((profiles / "dgx_h100" / "model" / "tiny.json").read_text())
    assert model["source"] == "analytic"
    assert model["method"]["device_sheet"]["name"] == "h100"  # conf/device/h100.yaml, from the wheel
