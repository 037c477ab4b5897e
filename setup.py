"""Package discovery for setuptools: every folder under the package roots is a subpackage of
``k3nvfp4`` (the roots are mapped in pyproject.toml's [tool.setuptools.package-dir]), so that no
hand-kept list can miss one. Everything else is in pyproject.toml."""

import pathlib

from setuptools import setup

ROOTS = {"common": "k3nvfp4.common", "kernels": "k3nvfp4.kernels", "checkpoint": "k3nvfp4.checkpoint",
         "sglang_ext": "k3nvfp4.sglang_ext", "demo": "k3nvfp4.demo"}


def packages() -> list[str]:
    here = pathlib.Path(__file__).resolve().parent
    out = []
    for folder, name in ROOTS.items():
        root = here / folder
        for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            if d.name == "__pycache__" or not any(f.is_file() for f in d.iterdir()):
                continue
            out.append(".".join([name, *d.relative_to(root).parts]))
    return out


setup(packages=packages())
