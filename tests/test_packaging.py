"""A built, non-editable wheel carries the grammar and the templates and works from any directory."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a pip wheel build and install (CI's set-up installs the editable package)
def test_wheel_ships_grammar_templates_and_runs(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), ROOT], check=True, capture_output=True)
    (wheel,) = list(wheels.glob("lrdsl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "lrdsl/frontend/lrdsl.lark" in names
    assert {"lrdsl/codegen/templates/module.py.jinja", "lrdsl/codegen/templates/chunk.py.jinja",
            "lrdsl/codegen/templates/recurrent.py.jinja", "lrdsl/codegen/plan.py"} <= names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    spec = work / "gdn.lr"
    spec.write_text(open(os.path.join(ROOT, "examples", "gated_deltanet.lr")).read())
    env = dict(os.environ, PYTHONPATH=str(target), LRDSL_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import lrdsl, sys; m = lrdsl.compile(sys.argv[1]); "
            "print(lrdsl.__file__); print(len(m.kernels.__doc__ or '') >= 0); "
            "import lrdsl.cli; sys.exit(lrdsl.cli.main(['check', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(spec)], cwd=work, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(str(target)), out.stdout
    assert "stable" in out.stdout
