"""Import every module of the installed kvjax (every package pyproject.toml installs, and each module
in it), so that a module importing something undeclared fails here, in a venv with no extras.
Run from outside the checkout: python .ci/import_all.py PYPROJECT"""
import importlib
import pkgutil
import sys
import tomllib

packages = tomllib.load(open(sys.argv[1], "rb"))["tool"]["setuptools"]["packages"]
names = []
for package in packages:
    module = importlib.import_module(package)
    names.append(package)
    for info in pkgutil.iter_modules(module.__path__, package + "."):
        if not info.ispkg:
            importlib.import_module(info.name)
            names.append(info.name)
print(f"imported {len(names)} modules of {len(packages)} packages: {', '.join(names)}")
