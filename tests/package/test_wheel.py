"""The built wheel is the product: installed outside the checkout, it runs the quick start and an
SFT job with the chat template it ships.

The wheel goes into a new virtual environment whose only other packages are this test
environment's dependencies, linked by a plain path entry. Plain path entries do not run the
``.pth`` files found there, so the editable install of this checkout stays out: the run can
import ``loader`` only from the wheel (checked, along with the working directory being outside
the checkout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("loader/chat/templates/chatml.jinja", "beam_jobs/assets/tokenizer.json")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (built,) = out.glob("zephon_loader-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A venv with the wheel installed (not editable) and this environment's dependencies."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, env=_clean_env())
    return env_dir


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(env_dir: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=dict(_clean_env(), PATH=f"{env_dir / 'bin'}:{os.environ['PATH']}"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return done


def test_wheel_holds_the_templates_and_assets(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert not any(name.startswith(("tests/", "bench/", "examples/", "docs/")) for name in names)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_runs_quickstart_and_an_sft_shard_outside_the_checkout(installed, tmp_path):
    python = str(installed / "bin" / "python")
    where = _run(installed, [python, "-c", "import loader, beam_jobs; print(loader.__file__); print(beam_jobs.__file__)"],
                 tmp_path).stdout.split()
    assert all(path.startswith(str(installed)) for path in where), where  # the wheel's copy, not the checkout's
    assert not str(tmp_path).startswith(str(ROOT))

    assert _run(installed, ["zephon", "--version"], tmp_path).stdout.startswith("zephon ")
    quick = _run(installed, ["zephon", "quickstart", "--out", "qs", "--docs", "300", "--steps", "3"], tmp_path)
    assert "resumed steps 2..2: 1/1 identical" in quick.stdout and "next:" in quick.stdout
    assert "WARNING:" not in quick.stderr and "Warning:" not in quick.stderr  # no dependency warns

    with open(tmp_path / "chat.jsonl", "w") as fh:
        for i in range(40):
            fh.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}) + "\n")
    _run(installed, ["zephon", "shard", "--input", "chat.jsonl", "--output", "sft", "--num-lanes", "4", "--id-field", "id",
                     "--messages-field", "messages", "--chat-template", "chatml"], tmp_path)
    manifest = json.loads((tmp_path / "sft" / "manifest.json").read_text())
    assert manifest["documents"] == 40 and manifest["chat"]["template_origin"] == "chatml"
    batch = _run(installed, [python, "-c", (
        "import loader; from loader.samples import default_tokenizer_path as t\n"
        "config = loader.LoaderConfig(datasets=[loader.SourceConfig(path='sft')], seq_len=128, global_batch_size=4, "
        "micro_batch_size=4, seed=0, packing='best_fit', tokenizer=t())\n"
        "data = loader.ZephonLoader(config, dp_rank=0, dp_world_size=1, output='numpy'); b = next(iter(data))\n"
        "print(int(b['loss_mask'].sum()), int((b['labels'] != -100).sum())); data.close()")], tmp_path)
    supervised, labelled = map(int, batch.stdout.split())
    assert 0 < supervised and labelled == supervised  # labels are -100 exactly where the mask is 0
