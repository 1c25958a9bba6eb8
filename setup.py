"""Package mapping for the card's folder layout (see pyproject.toml).

setuptools cannot discover sub-packages under a remapped directory by itself, so they are listed
here: folder runtime/ is package rldock.runtime, folder operator/ is rldock.operator.
"""

from setuptools import find_packages, setup

FOLDERS = {"rldock": "rldock", "rldock.runtime": "runtime", "rldock.operator": "operator"}

packages = []
for package, folder in FOLDERS.items():
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=FOLDERS)
