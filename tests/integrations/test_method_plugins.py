"""A package declares its own method through the ``cacheblend_rag.methods`` entry point group, and the
command line, in a process of its own, answers with it: no file of cacheblend-rag names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cacheblend_rag.blend import MethodSpec, available_methods, methods

PLUGIN = '''
from pydantic import Field

from cacheblend_rag.blend import RecomputeMethod


class EveryThird(RecomputeMethod):
    """Recomputes every third cached token, starting at ``offset``."""

    name = "plugin_every_third"
    shorthand = "offset"

    offset: int = Field(0, ge=0, le=2, description="first cached token recomputed")

    def layer0_positions(self, plan):
        keep = plan.must_compute.clone()
        keep[plan.cached_mask.nonzero().squeeze(1)[self.offset :: 3]] = True
        return keep.nonzero().squeeze(1)
'''


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A folder holding an installed distribution (its dist-info) whose entry point names the method."""
    (tmp_path / "third_plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "third_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[cacheblend_rag.methods]\nplugin_every_third = third_plugin:EveryThird\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(methods, "_plugins_loaded", False)  # look the entry points up again
    return tmp_path


def test_an_entry_point_registers_the_method(plugin_path):
    spec = MethodSpec.parse("plugin_every_third@1")
    assert spec.label == "plugin_every_third@1" and spec.options == (("offset", 1),)
    assert spec.build().describe() == {"method": "plugin_every_third", "offset": 1}
    assert "plugin_every_third" in available_methods()
    with pytest.raises(ValueError, match="offset"):
        MethodSpec.parse("plugin_every_third@offset=3")


def test_the_command_line_answers_with_it(plugin_path, corpus_dir, question):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-c", "import sys; from cacheblend_rag.cli import app; sys.exit(app())"]
    args = ["query", question, "--corpus", corpus_dir, "--top-k", "2", "--max-tokens", "3", "--json"]
    done = subprocess.run(
        [*cli, *args, "--method", "plugin_every_third@2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["method_options"] == {"method": "plugin_every_third", "offset": 2}
    assert answer["recompute_ratio"] == pytest.approx(1 / 3, abs=0.02)
