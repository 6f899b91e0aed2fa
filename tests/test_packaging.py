"""kvjax installs as one package: a regular (non-editable) install puts only `kvjax` and its
dist-info into site-packages, with the repository's models/ and experiments/ inside it as
kvjax.models and kvjax.experiments, so a user's own top-level `models` package neither shadows
nor is overwritten by kvjax's. Built from a copy of the checkout's source with the installed
setuptools (no build isolation, nothing fetched), installed with `pip --target` into a folder."""
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("pyproject.toml", "README.md", "kvjax", "models", "experiments")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def test_every_source_package_is_installed():
    """Each folder with an __init__.py under kvjax/, models/ and experiments/ is in pyproject's package
    list under the name it has installed, or a regular install would silently leave it out."""
    setup = _pyproject()["tool"]["setuptools"]
    dirs = {v: k for k, v in setup["package-dir"].items()}  # folder -> installed name
    found = set()
    for top in ("kvjax", "models", "experiments"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, ROOT).split(os.sep)
                found.add(".".join([dirs.get(rel[0], rel[0]), *rel[1:]]))
    assert found == set(setup["packages"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:  # a copy, so no build/ folder of an earlier build in the checkout leaks in
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("kvjax-*.whl")
    return whl


def test_wheel_installs_only_kvjax(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    version = _pyproject()["project"]["version"]
    assert {n.split("/")[0] for n in names} == {"kvjax", f"kvjax-{version}.dist-info"}
    for path in ("kvjax/models/hub.py", "kvjax/models/checkpoints/small-gqa/model.safetensors",
                 "kvjax/experiments/decode_bench.py", "kvjax/experiments/gpu_check.sh", "kvjax/data/stdlib_heldout.txt",
                 "kvjax/entrypoints/static/calculator.js", "kvjax/entrypoints/static/pool.html"):
        assert path in names, path


@pytest.mark.slow
def test_installed_kvjax_runs_beside_a_users_own_models_package(wheel, tmp_path):
    site, user = tmp_path / "site", tmp_path / "project"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "kvjax"]  # bin: the script
    for pkg in ("models", "experiments"):  # a machine-learning repository's own packages
        (user / pkg).mkdir(parents=True)
        (user / pkg / "__init__.py").write_text(f"OWNER = 'the user'  # {pkg}\n")
    code = """if True:
        import os, sys
        import kvjax, kvjax.models, kvjax.experiments
        import models, experiments
        site = sys.argv[1]
        for m in (kvjax, kvjax.models, kvjax.experiments):
            assert m.__file__.startswith(site), m.__file__
        assert models.OWNER == experiments.OWNER == 'the user'
        llm = kvjax.LLM('small-gqa', max_num_seqs=2)
        out = llm.generate(['def f(x):'], kvjax.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4, out[0]
        print('ok', out[0].outputs[0].text.encode())
    """
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the checkout's editable install on sys.path
    p = subprocess.run([sys.executable, "-c", code, str(site)], cwd=user, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stderr[-2000:]


@pytest.mark.parametrize("blocked, argv, extra", [
    ("torch", "from kvjax.experiments import decode_bench; decode_bench.main(['--vs-transformers', '--tiny'])", "bench"),
    pytest.param("transformers", "from kvjax.experiments import decode_bench; decode_bench.main(['--vs-transformers', "
                 "'--tiny'])", "bench", marks=pytest.mark.slow),  # the same extra as torch's
    ("optax", "from kvjax.experiments import train_small; train_small.main(['--model', 'gqa', '--steps', '1'])", "train"),
])
def test_an_experiment_names_the_extra_it_needs(blocked, argv, extra, tmp_path):
    """Without the package an extra brings (a None in sys.modules makes its import fail, as in a venv
    made by the main install alone): one line, exit status 2, naming the extra; nothing written."""
    code = f"import sys; sys.modules[{blocked!r}] = None; {argv}"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.count("\n") == 1 and f"kvjax[{extra}]" in p.stderr and blocked in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_checkout_imports_one_tree():
    """Run from the checkout (pytest from its root, or its editable install), kvjax.models and
    kvjax.experiments are the checkout's own top-level folders, beside the kvjax/ that was imported."""
    import kvjax
    import kvjax.experiments
    import kvjax.models
    here = os.path.dirname(os.path.dirname(kvjax.__file__))
    assert here == ROOT
    assert kvjax.models.__file__ == os.path.join(ROOT, "models", "__init__.py")
    assert kvjax.experiments.__file__ == os.path.join(ROOT, "experiments", "__init__.py")
