"""Package build: every piece of metadata comes from settings.ini."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=["="])
cfg.read(here / "settings.ini", encoding="utf-8")
s = cfg["DEFAULT"]

licenses = {"apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License")}
lic_name, lic_classifier = licenses[s["license"]]
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable"]
min_py = s["min_python"]
py_versions = [f"3.{m}" for m in range(int(min_py.split(".")[1]), 14)]
readme = here / "README.md"

setuptools.setup(
    name=s["lib_name"],
    version=s["version"],
    description=s["description"],
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else s["description"],
    long_description_content_type="text/markdown",
    author=s["author"],
    author_email=s["author_email"],
    url=s["git_url"],
    license=lic_name,
    keywords=s["keywords"].split(),
    classifiers=[
        f"Development Status :: {statuses[int(s['status']) - 1]}",
        f"Intended Audience :: {s['audience']}",
        f"License :: {lic_classifier}",
        f"Natural Language :: {s['language']}",
        *[f"Programming Language :: Python :: {v}" for v in py_versions],
    ],
    python_requires=f">={min_py}",
    packages=setuptools.find_packages(include=[s["lib_path"], f"{s['lib_path']}.*"]),
    include_package_data=True,
    package_data={s["lib_path"]: ["assets/*", "assets/**/*"]},
    install_requires=s.get("requirements", "").split(),
    # each `<name>_requirements` line of settings.ini is the extra `tunebook[<name>]`
    extras_require={k.removesuffix("_requirements"): v.split() for k, v in s.items() if k.endswith("_requirements")},
    entry_points={"console_scripts": s.get("console_scripts", "").split(), "nbdev": [f"{s['lib_path']}={s['lib_path']}._modidx:d"]},
    zip_safe=False,
)
