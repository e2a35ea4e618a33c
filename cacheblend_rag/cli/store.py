"""``cacheblend-rag store``: inspect and maintain the chunk KV store of a corpus directory (DIR/kv), and
the shared remote KV tier with ``--kv-remote`` (or ``CACHEBLEND_KV_REMOTE``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..errors import CacheBlendError, StoreError
from ..settings import Settings, get_settings
from .output import print_error, shown
from .overrides import KV_REMOTE_OPTION, use_kv_remote
from .progress import ProgressReporter

store_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain the chunk KV store (DIR/kv).")
console = Console()

CORPUS_OPTION = typer.Option(..., "--corpus", help="Corpus directory (its chunk KV store lives in DIR/kv).")
JSON_OPTION = typer.Option(False, "--json", help="Print the result as JSON.")


def open_kv_store(corpus_dir: Path, settings: Settings | None = None):
    """The KV store of ``corpus_dir``; the model fingerprint comes from DIR/manifest.json, else the index.
    ``settings``: the command's (its budgets, remote tier and preferred codec; default: the process's)."""
    from ..store.kvstore import KV_INDEX_NAME, KVStore
    from ..store.shared import KVStoreOptions

    kv_root = corpus_dir / "kv"
    if not (kv_root / KV_INDEX_NAME).is_file():
        raise StoreError(f"no KV store at {kv_root}: ingest documents into {corpus_dir} first")
    fingerprint, options = None, {}
    manifest = corpus_dir / "manifest.json"
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text())
            fingerprint = recorded.get("model_fingerprint")
            if recorded.get("kv_dtype"):  # the codec the corpus stores its KV in
                options["kv_dtype"] = recorded["kv_dtype"]
        except (ValueError, AttributeError) as exc:
            raise StoreError(f"unreadable corpus manifest {manifest}: {exc}") from exc
    settings = get_settings() if settings is None else settings
    options.update(KVStoreOptions.of(settings).store_kwargs())
    return KVStore.open_existing(kv_root, fingerprint, settings.kv_dtype, **options)


def _run(corpus_dir: Path, action, kv_remote: str | None = None):
    try:
        store = open_kv_store(corpus_dir, use_kv_remote(kv_remote))
        try:
            return action(store)
        finally:
            store.close()
    except CacheBlendError as exc:
        print_error(console, exc)
        raise typer.Exit(1) from exc


def _print_json(data) -> None:
    console.print_json(json.dumps(data, default=str))


def _stats(store) -> dict:
    data = store.stats()
    if store.remote is not None:
        data["remote"] = store.remote.stats()  # a scan of the server, beyond this process's counters
    return data


@store_app.command("stats")
def stats(
    corpus: Path = CORPUS_OPTION,
    as_json: bool = JSON_OPTION,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
) -> None:
    """Entries and bytes per tier (the remote tier's too), budgets, model and dtype."""
    data = _run(corpus, _stats, kv_remote)
    if as_json:
        _print_json(data)
        return
    table = Table(title=f"KV store {data['root']}")
    table.add_column("tier")
    table.add_column("entries", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("budget", justify="right")
    for tier in ("ram", "disk"):
        row = data[tier]
        table.add_row(tier, str(row["entries"]), f"{row['bytes']:,}", f"{row['budget_bytes']:,}")
    remote = data["remote"]
    if remote is not None and remote["available"]:
        maxmemory = remote["server"]["maxmemory"]
        entries = f"{remote['entries']} ({remote['pinned']} pinned)"
        budget = f"{maxmemory:,} (server)" if maxmemory else "unlimited"
        table.add_row("remote", entries, f"{remote['bytes']:,}", budget)
    console.print(table)
    if remote is not None:
        state = "" if remote["available"] else f"  [red]unreachable[/red]: {shown(remote.get('error', ''))}"
        console.print(
            f"remote tier {shown(remote['url'])} prefix {shown(remote['prefix'])}{state}", highlight=False
        )
    read_only = "  [yellow](read-only)[/yellow]" if data["read_only"] else ""
    console.print(
        f"model {data['model_fingerprint'][:16]}…  codec {data['kv_dtype']}  "
        f"layout v{data['layout_version']}  models in store {data['disk']['models']}{read_only}"
    )
    for codec, row in data["disk"]["by_codec"].items():
        console.print(
            f"  {codec}: {row['entries']} chunks, {row['tokens']:,} tokens, {row['bytes']:,} bytes, "
            f"{row['bytes_per_token']:,.0f} bytes per token (file bytes, metadata included)",
            highlight=False,
        )


def _verify(store, repair: bool):
    """The local report and, with a remote tier, the remote one (raises StoreError if unreachable)."""
    local = store.verify(repair=repair)
    return local, (store.remote.verify(repair=repair) if store.remote is not None else None)


@store_app.command("verify")
def verify(
    corpus: Path = CORPUS_OPTION,
    repair: bool = typer.Option(
        False, "--repair", help="Remove corrupt files (and remote values) and fix the index."
    ),
    as_json: bool = JSON_OPTION,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
) -> None:
    """Read every stored file and check it (metadata, every layer's checksum) and the index; with a
    remote tier, every value on the server too."""
    report, remote = _run(corpus, lambda s: _verify(s, repair), kv_remote)
    clean = report.clean and (remote is None or remote.clean)
    if as_json:
        data = report.as_dict()
        if remote is not None:
            data["remote"] = remote.as_dict()
            data["clean"] = clean
        _print_json(data)
    else:
        console.print(f"checked {report.checked} files: {report.ok} ok, {len(report.corrupt)} corrupt")
        for bad in report.corrupt:
            console.print(f"  [red]corrupt[/red] {bad['key'][:16]}…: {shown(bad['reason'])}")
        for label, keys in (
            ("index rows without a file", report.missing_files),
            ("files without an index row", report.orphan_files),
            ("leftover temp files", report.stale_temp_files),
        ):
            if keys:
                console.print(f"  {len(keys)} {label}")
        if remote is not None:
            console.print(
                f"remote tier: checked {remote.checked} chunks: {remote.ok} ok ({remote.pinned} pinned), "
                f"{len(remote.corrupt)} corrupt, {len(remote.stray_keys)} stray keys"
            )
            for bad in remote.corrupt:
                console.print(f"  [red]corrupt[/red] remote {bad['key'][:16]}…: {shown(bad['reason'])}")
        if not clean:
            console.print("repaired" if repair else "run again with --repair to fix")
    if not clean and not repair:
        raise typer.Exit(1)


def _gc(store) -> dict:
    report = store.gc()
    if store.remote is not None:
        report.update({f"remote_{name}": count for name, count in store.remote.gc().items()})
    return report


@store_app.command("gc")
def gc(
    corpus: Path = CORPUS_OPTION,
    as_json: bool = JSON_OPTION,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
) -> None:
    """Enforce the disk budget (LRU) and reconcile the index with the files; with a remote tier, delete
    what it can never serve."""
    report = _run(corpus, _gc, kv_remote)
    if as_json:
        _print_json(report)
    else:
        console.print(", ".join(f"{name.replace('_', ' ')}: {count}" for name, count in report.items()))


@store_app.command("clear")
def clear(
    corpus: Path = CORPUS_OPTION,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask to confirm."),
) -> None:
    """Remove every cached chunk KV (the documents and their index are kept)."""
    if not yes:
        typer.confirm(f"Remove all cached KV in {corpus / 'kv'}?", abort=True)
    removed = _run(corpus, lambda s: s.clear())
    console.print(f"removed {removed} chunk files")


@store_app.command("recode")
def recode(
    corpus: Path = CORPUS_OPTION,
    kv_dtype: str = typer.Option(
        ..., "--kv-dtype", help="The new codec: float16, bfloat16, float32, int8, int4."
    ),
    as_json: bool = JSON_OPTION,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
) -> None:
    """Convert the corpus's chunk KV to a coarser codec in place (crash-safe: run it again after a crash
    to finish); with a remote tier, its values too. A finer codec is refused: re-ingest for it."""
    from ..corpus.recode import recode_corpus

    try:
        settings = use_kv_remote(kv_remote)
        # progress on stderr: stdout holds the report (--json)
        with ProgressReporter(Console(stderr=True), {"chunks": "recode (chunks)"}) as progress:
            report = recode_corpus(
                corpus,
                kv_dtype,
                settings.kv_dtype,
                settings.kv_remote,
                progress=lambda done, total: progress.update("chunks", done, total),
            )
    except (CacheBlendError, ValueError) as exc:
        print_error(console, exc)
        raise typer.Exit(1) from exc
    if as_json:
        _print_json(report.as_dict())
        return
    console.print(
        f"{report.old_codec} -> {report.new_codec}: {report.converted} chunks converted, "
        f"{report.already_done} already done, {report.not_stored} not computed yet, "
        f"{len(report.unreadable)} unreadable (to recompute), {report.old_files_removed} old files removed",
        highlight=False,
    )
    if report.old_bytes:
        console.print(
            f"bytes {report.old_bytes:,} -> {report.new_bytes:,} ({report.new_bytes / report.old_bytes:.3f}x)"
        )
