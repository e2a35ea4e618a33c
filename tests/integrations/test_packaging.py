"""The LangChain package's metadata as PyPI and LangChain's integration listing expect it:
name, a version matching cacheblend-rag's, classifiers, keywords, its README."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_langchain_package_metadata_is_complete():
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    package = ROOT / "integrations" / "langchain-cacheblend"
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert project["name"] == "langchain-cacheblend" and project["version"] == core["version"]
    assert f"cacheblend-rag>={core['version']}" in project["dependencies"]
    classifiers = set(project["classifiers"])
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    assert {"Programming Language :: Python :: 3.11", "Typing :: Typed"} <= classifiers
    assert "langchain" in project["keywords"] and (package / project["readme"]).is_file()
    assert (package / "langchain_cacheblend" / "py.typed").is_file()
