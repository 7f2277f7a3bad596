"""Package discovery: `templates/` (top of the repository) ships inside the package as `vlmctl.templates`."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["vlmctl", "vlmctl.*"]) + ["vlmctl.templates"],
    package_dir={"vlmctl.templates": "templates"},
)
