"""Which packages the wheel holds (the metadata and dependencies are in setup.cfg).

The repository keeps ``theory/``, ``algorithms/`` and ``experiments/`` as top-level folders; the wheel
installs them as ``sparsecomm.theory``, ``sparsecomm.algorithms`` and ``sparsecomm.experiments``, so that
nothing but ``sparsecomm`` lands at the top of site-packages (``sparsecomm/_tree.py`` gives the source
tree the same names). ``tests/repo/test_packaging.py`` checks the built wheel.
"""

from setuptools import find_packages, setup

MAPPED = ("theory", "algorithms", "experiments")

packages = find_packages(include=["sparsecomm", "sparsecomm.*"])
package_dir = {}
for top in MAPPED:
    packages += ["sparsecomm." + p for p in find_packages(include=[top, top + ".*"])]
    package_dir["sparsecomm." + top] = top

setup(packages=packages, package_dir=package_dir,
      package_data={"sparsecomm.experiments": ["*.yaml"]})
