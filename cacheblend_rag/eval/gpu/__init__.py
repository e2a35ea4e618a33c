"""The accelerator check: CacheBlend against full prefill on one GPU, in one short call, and r = 1 exact.

    python -m cacheblend_rag.eval.gpu [--device cuda] [--config llama-3.1-8b,qwen2.5-1.5b]
        [--workloads 6x512,20x512,8x2048] [--repeats 5] [--warmup 2] [--json gpu_check.json] [--profile]
        [--batch N]
    python -m cacheblend_rag.eval.gpu --render gpu_check.json     # a saved run as BENCHMARKS.md's tables

(``cacheblend-rag gpu-check ARGS`` runs the same where the whole package is installed.)

For each model config (random weights in the shape of a named real model, built in plain torch by
:mod:`.models`: nothing is downloaded and ``transformers`` is not needed) and each workload ``NxL`` (N
cached chunks of L tokens between a short fresh head and a fresh question), it times, median of
``--repeats`` after ``--warmup`` runs (CUDA events on CUDA, wall clock elsewhere):

- ``full_prefill``: the model's forward over the whole prompt;
- ``cacheblend`` (the default: query-aware selection and the chunk-shift correction, r = 0.15),
  ``cacheblend_hkvd`` (the paper's rule at the same r, without the shift), ``full_reuse`` and ``epic``,
  each fusing the precomputed chunk KV through our ``Fusor``,
  with that KV held in device memory (``hbm``) and in pinned host RAM (``host``; on CPU only ``ram``).

Every time runs to the first token's logits. ``--profile`` adds, at each config's first workload, where the
time goes: the time until the device finished, its kernels' own time and count, the host's time in torch
ops (a device that idles while the host dispatches shows kernel time far below the finish time).
``--batch N`` adds, at each config's first workload, N different prompts at once as a server batches
concurrent requests: full prefill of all in one forward against fusing all together (``fuse_many``).
It then checks ``cacheblend@ratio=1`` against full prefill (relative L2 error of the logits within the
compute dtype's bound) and exits non-zero when it is not, prints one table and writes JSON (rows appended
as they are measured, so a run cut short keeps what it did).

It imports only torch, numpy and the package's ``models``, ``blend`` and ``store`` layers (which need
pydantic, pydantic-settings, platformdirs, python-dotenv and safetensors); on a GPU machine without network
carry their wheels (``make gpu-wheels`` downloads them into ``.whl/``) and start it from the checkout with

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    python3 -m cacheblend_rag.eval.gpu --json $OUT/gpu_check.json

It ran on an H200 (docs/notes/benchmarks-gpu-h200.md) and on an H100 with both fusion paths
(BENCHMARKS.md, section ``gpu``), as ``scripts/gpu_check.py`` then. ``--device cpu --config tiny`` runs
in ``make test`` (tests/eval/test_gpu_check.py) so this path cannot rot.
"""
