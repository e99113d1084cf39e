"""Package layout for setuptools (the rest of the metadata is in pyproject.toml).

The YAML configs live at the top of the repository (configs/) and ship inside the wheel as `longspec/configs`, where
`longspec.config.config_root` finds them once installed; a source checkout reads configs/ in place.
"""

from setuptools import find_namespace_packages, setup

CONFIG_PACKAGES = ["longspec.configs", *(f"longspec.configs.{p}" for p in find_namespace_packages("configs"))]

setup(
    packages=[
        *find_namespace_packages(include=["longspec", "longspec.*", "data_prep", "data_prep.*"]),
        *CONFIG_PACKAGES,
    ],
    package_dir={"longspec.configs": "configs"},
)
