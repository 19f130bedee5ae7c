"""Packaging: the repository's top-level folders install under one `vlbatch` import namespace.

The folders keep the names the design gives them (operators/, pipeline/, jobs/, models/),
and `scripts/devtools/` holds the tools that make test and demo data; each installs as
`vlbatch.<name>` (`vlbatch.operators.engine`, `vlbatch.devtools.checkpoints`, ...), so
nothing generic like `operators` or `pipeline` lands in site-packages. `vlbatch` itself is
an implicit namespace package (no folder of its own in the repository). Project metadata and
dependencies are in pyproject.toml.
"""
from setuptools import find_packages, setup

ROOTS = {  # import name under vlbatch -> folder in the repository
    "operators": "operators",
    "pipeline": "pipeline",
    "jobs": "jobs",
    "models": "models",
    "devtools": "scripts/devtools",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        package_dir[f"vlbatch.{name}"] = folder
        packages.append(f"vlbatch.{name}")
        packages += [f"vlbatch.{name}.{sub}" for sub in find_packages(folder)]
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={
        "": ["*.json", "*.jinja", "*.safetensors", "*.txt"],
        "vlbatch.devtools.checkpoints": ["assets/*"],  # the tokenizer and chat template of tiny checkpoints
        # the bundled demo checkpoint (models/shapes-tiny: HF layout, a few MB)
        "vlbatch.models": ["shapes-tiny/*"],
    },
)
