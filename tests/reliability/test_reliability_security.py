"""Security: no unsafe deserialisation anywhere in the code, FAISS indexes kept in faiss' own format, and no
file or folder of a store world-writable, even when built under umask 000."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import faiss
from reliability_support import answer

from cacheblend_rag.corpus.chunkdb import FAISS_INDEX_NAME
from cacheblend_rag.store.kvstore import KVStore

ROOT = Path(__file__).parents[2]
SCANNED = ["cacheblend_rag", "integrations", "examples", "tests"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
# every fourcc faiss writes for the index types a store may hold (flat, IVF, HNSW; with an id map)
FAISS_FOURCCS = {b"IxM2", b"IxMp", b"IxFI", b"IwFl", b"IHNf", b"IHNF"}


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) for each unsafe deserialisation or dynamic code execution in ``source``."""
    found: list[tuple[int, str]] = []
    imported_from: dict[str, str] = {}  # local name -> "module.name" for ``from module import name``
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                imported_from[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                name = f"{func.value.id}.{func.attr}"
            elif isinstance(func, ast.Name):
                name = imported_from.get(func.id, func.id)
            else:
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
                found.append((node.lineno, f"{name}()"))
            elif name == "torch.load" and not _is_true(keywords.get("weights_only")):
                found.append((node.lineno, "torch.load without weights_only=True"))
            elif name in ("np.load", "numpy.load") and _is_true(keywords.get("allow_pickle")):
                found.append((node.lineno, f"{name}(allow_pickle=True)"))
            elif name == "yaml.load" and "Loader" not in keywords:
                found.append((node.lineno, "yaml.load without a safe Loader"))
            elif "pickle" in name.lower():
                found.append((node.lineno, f"{name}()"))
    return found


def test_the_scanner_finds_what_it_looks_for():
    planted = """
import pickle
from joblib import load as jl
import torch, numpy as np, yaml, pandas as pd
from torch import load
torch.load("a.pt")
torch.load("a.pt", weights_only=False)
load("a.pt")
np.load("a.npy", allow_pickle=True)
yaml.load(text)
pd.read_pickle("x")
eval("1 + 1")
exec(code)
torch.load("a.pt", weights_only=True)
model.eval()
np.load("a.npy")
"""
    assert [line for line, _ in unsafe_calls(planted)] == [2, 3, 6, 7, 8, 9, 10, 11, 12, 13]


def test_no_pickle_no_unsafe_torch_load_no_eval_in_the_code(faults):
    files = [p for top in SCANNED for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts]
    assert len(files) > 50  # the scan really covers the package, its integrations, examples and tests
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        for line, what in unsafe_calls(path.read_text(encoding="utf-8"))
    ]
    handling = f"AST scan of {len(files)} files: pickle, torch.load, eval/exec, allow_pickle"
    faults.record("security", "unsafe deserialisation or eval in code", handling)
    assert not problems, "\n".join(problems)


def test_faiss_index_is_written_and_read_by_faiss(rel_store, faults):
    path = rel_store / FAISS_INDEX_NAME
    with open(path, "rb") as fh:
        assert fh.read(4) in FAISS_FOURCCS  # faiss' own format, not a pickle or numpy dump
    index = faiss.read_index(str(path))
    with KVStore.open_existing(rel_store / "kv") as kv:
        assert index.ntotal == kv.stats()["disk"]["entries"] > 0
    faults.record("security", "FAISS index format", "faiss' own fourcc header; read back by faiss.read_index")


def test_no_store_file_or_folder_is_world_writable(store_copy, rag_on, reference, rel_questions, faults):
    """The shared store was ingested under umask 000; here a query also writes KV back under umask 000."""
    question = rel_questions[1]
    root = store_copy()
    with KVStore.open_existing(root / "kv") as kv:
        kv.delete(reference.kv_keys(question)[0])
    old = os.umask(0)
    try:
        with rag_on(root) as rag:
            got = {(question, "cacheblend"): answer(rag, question)}
            # walk while the store is open, so that SQLite's -wal and -shm files are checked too
            paths = [root, *root.rglob("*")]
            writable = [str(p.relative_to(root)) for p in paths if p.stat().st_mode & stat.S_IWOTH]
    finally:
        os.umask(old)
    assert len(paths) > 10 and any(p.name.endswith("-wal") for p in paths)
    assert not writable, writable
    want = reference.answers([(question, "cacheblend")])
    handling = f"{len(paths)} paths checked after ingest and write-back: none world-writable"
    assert not faults.record("security", "umask 000 during ingest and write-back", handling, got, want)
