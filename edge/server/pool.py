"""The models `edge serve` holds: loaded on demand by name, unloaded when idle (Ollama's model
scheduling, llama-server's router mode).

Started without ``-m``, the server serves every model in the store (``edge list``): a
request's ``model`` (a registry name or alias, a pulled Hub name, a store file's stem, with or
without Ollama's ``:latest`` tag) loads that model on first use. The default model loads at
start. At most ``--models-max`` models (default 3) and ``--models-memory`` bytes (file sizes
plus KV pools; default three quarters of physical memory) are held; to load another, the
least recently used idle model is unloaded, and when every held model is busy the request
gets a 503 with Retry-After. A model idle for its keep-alive (``--keep-alive``, default 5
minutes, or the last request's ``keep_alive``: seconds or a duration such as "10m"; 0 =
unload once idle, negative = never) is unloaded. Started with ``-m``, the server holds that
one model and never unloads it.

Requests for a model being loaded wait for it up to ``--load-timeout`` seconds (then 503 with
Retry-After). Every model runs its own Scheduler; their forward passes take turns
(edge.server.scheduler.STEP_LOCK): the cores are shared, and numba's workqueue threading layer
must not be entered by two threads at once.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edge.server import protocol as P

GB = 1 << 30
DEFAULT_KEEP_ALIVE = 300.0
BUSY_GRACE = 2.0          # seconds a request waits for a held model to go idle before a 503


def physical_memory() -> int:
    """Bytes of physical memory (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def store_model(name: str) -> Path | None:
    """The stored GGUF a request's model name means, without network or pulling: a registry
    name or alias (pulled), a pulled Hub name (hf.co/USER/REPO[:QUANT]), the stem or file name
    of a ``*.gguf`` in the store; Ollama's ``:latest`` tag is dropped. None for anything else
    (paths included: a client does not choose files on the server's disk)."""
    from edge.store import StoreError, find_entry, models_dir, resolve_model, store_hf

    name = name.strip()
    candidates = [name]
    if name.endswith(":latest"):
        candidates.append(name[: -len(":latest")])
    for cand in candidates:
        if not cand or "\0" in cand:
            continue
        if store_hf.is_hub_name(cand) or find_entry(cand) is not None:
            try:
                return resolve_model(cand, pull_missing=False)
            except StoreError:
                continue
        stem = cand[: -len(".gguf")] if cand.endswith(".gguf") else cand
        if "/" in stem or "\\" in stem or stem.startswith("."):
            continue
        local = models_dir() / f"{stem}.gguf"
        if local.is_file():
            return local
    return None


class ModelSlot:
    """One model of the pool: its engine and scheduler once loaded.

    status: "loading", "loaded" or "error" (then ``error``); ``ready`` is set when the load ended
    either way. ``leases``: requests between acquire() and their submission (a model with a
    lease or a request in its scheduler is busy and is never unloaded)."""

    def __init__(self, path: Path, arg: str | None = None, alias: str | None = None):
        self.path, self.arg = Path(path), arg
        self.name = alias or _model_id(self.path)
        self.engine = None
        self.scheduler = None
        self.status = "loading"
        self.error: str | None = None
        self.ready = threading.Event()
        self.leases = 0
        self.keep_alive: float | None = DEFAULT_KEEP_ALIVE
        self.last_active = time.monotonic()
        self.loaded_at: float | None = None
        self.load_seconds: float | None = None
        self._max_piece: int | None = None
        self.bytes = self.path.stat().st_size if self.path.exists() else 0

    def busy(self) -> bool:
        return self.leases > 0 or (self.scheduler is not None and self.scheduler.busy())

    def expires_at(self) -> float | None:
        """Epoch seconds at which the idle model unloads (None: kept)."""
        if self.keep_alive is None:
            return None
        return time.time() + max(0.0, self.last_active + self.keep_alive - time.monotonic())

    def max_piece_bytes(self) -> int:
        """Bytes of the vocabulary's longest token (computed once)."""
        if self._max_piece is None:
            tok = self.engine.tokenizer
            self._max_piece = max(1, max(len(tok.token_to_piece(i, special=True))
                                         for i in range(self.engine.model.args.n_vocab)))
        return self._max_piece

    def names(self) -> set[str]:
        """Names a request's ``model`` may use: the GGUF's general.name, the -m argument, the
        file's name and stem, its display name and ``:latest`` form, and the registry's aliases."""
        from edge.store import find_entry

        stem = self.path.stem
        entry = find_entry(stem)
        names = {self.name, f"{self.name}:latest", _model_id(self.path), self.path.name, stem,
                 *((entry.name, *entry.aliases) if entry is not None and entry.name == stem else ())}
        if self.engine is not None and self.engine.name:
            names.add(self.engine.name)
        if self.arg:
            names |= {self.arg, Path(self.arg).name, Path(self.arg).stem}
        return {n for n in names if n}


def _model_id(path: Path) -> str:
    """A model's id in responses: the store's display name of the file's stem (the name `edge
    list` shows and `-m` takes, e.g. qwen2.5-coder-0.5b-instruct, hf.co/USER/REPO:TAG)."""
    from edge.store import store_hf

    return store_hf.display_name(path.stem)


class ModelPool:
    """The server's models (module docstring). ``load_model(slot)`` builds a slot's engine and
    scheduler on the calling thread (ServerState's); ``default`` is the model that loads at start
    and answers requests that name none."""

    def __init__(self, load_model: Callable[[ModelSlot], None], router: bool, models_max: int = 3,
                 memory_budget: int | None = None, keep_alive: float | None = DEFAULT_KEEP_ALIVE,
                 load_timeout: float = 300.0, on_event: Callable[[str], None] | None = None):
        self._load_model = load_model
        self._on_event = on_event or (lambda message: None)
        self.router = router
        self.models_max = max(1, models_max)
        mem = physical_memory()
        self.memory_budget = memory_budget if memory_budget is not None else (mem * 3 // 4 if mem else None)
        self.keep_alive = keep_alive
        self.load_timeout = load_timeout
        self.slots: dict[Path, ModelSlot] = {}
        self.default: ModelSlot | None = None
        self.default_path: Path | None = None   # the default model's file, also while it is unloaded
        self._lock = threading.Lock()
        self.unloaded = 0          # models unloaded since start (metrics)

    # ---- lookup --------------------------------------------------------------------------------

    def start_default(self, path: Path, arg: str | None, alias: str | None = None) -> ModelSlot:
        """The default model's slot (loaded by the caller, on its thread); ``alias``: its name in
        responses (--alias)."""
        slot = ModelSlot(path, arg, alias)
        if not self.router:
            slot.keep_alive = None
        else:
            slot.keep_alive = self.keep_alive
        with self._lock:
            self.slots[slot.path] = slot
            self.default, self.default_path = slot, slot.path
        return slot

    def find(self, model: str | None, any_name: bool = False) -> ModelSlot | None:
        """The slot serving ``model`` (None: the default) if it is held, else None. With
        ``any_name`` a server started with -m serves every name with its one model (llama-server's
        behaviour: apps hard-code "gpt-4o-mini" or "local-model")."""
        if model is None or (any_name and not self.router):
            return self.default
        with self._lock:
            slots = list(self.slots.values())
        for slot in slots:
            if model in slot.names():
                return slot
        return None

    def _not_found(self, model: str) -> P.APIError:
        if self.router:
            msg = (f"The model {model!r} does not exist: it is not a pulled model (edge list; edge pull NAME "
                   f"fetches one; GET /v1/models)")
        else:
            served = self.default.name if self.default is not None else "?"
            msg = f"The model {model!r} does not exist: this server serves {served!r} (GET /v1/models)"
        return P.APIError(404, msg, param="model", code="model_not_found")

    def loaded(self) -> list[ModelSlot]:
        with self._lock:
            return [s for s in self.slots.values() if s.status == "loaded"]

    # ---- acquire / release ---------------------------------------------------------------------

    async def acquire(self, model: str | None, keep_alive: float | None | str = "default",
                      any_name: bool = True, check: Callable[[Path, str], None] | None = None) -> ModelSlot:
        """The slot of ``model`` (None: the default), loaded, with a lease the caller gives back
        with release() once its request is submitted (or failed). Loads it first when it is a
        pulled model not held (router mode), unloading idle ones to make room.

        Raises APIError: 404 model_not_found; 503 (Retry-After) while it loads past
        --load-timeout, when every held model is busy and the pool is full, or when its load
        failed (model_load_failed); whatever ``check(path, name)`` raises for a model that is not
        held, before it is loaded (e.g. a chat to a model without a chat template: a 400 at once,
        not after its load)."""
        slot = self.find(model, any_name)
        if slot is None:
            if not self.router:
                raise self._not_found(model)
            # no name: the default model, loaded again when it was unloaded (its path is no name)
            path = self.default_path if model is None else await asyncio.to_thread(store_model, model)
            if path is None:
                raise self._not_found(model)
            if check is not None and path not in self.slots:
                await asyncio.to_thread(check, path, model or _model_id(path))
            deadline = time.monotonic() + BUSY_GRACE
            while True:
                try:
                    slot = self._slot_to_load(path, model)
                    break
                except P.APIError as e:        # held models busy: one may be finishing its last step
                    if e.code != "models_busy" or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
        slot.leases += 1
        slot.last_active = time.monotonic()
        try:
            if not slot.ready.is_set():
                ok = await asyncio.to_thread(slot.ready.wait, self.load_timeout)
                if not ok:
                    raise P.APIError(503, f"the model {slot.name!r} is still loading; retry shortly", code="loading",
                                     headers={"Retry-After": "5"})
            if slot.status != "loaded":
                raise P.APIError(503, f"the model {slot.name!r} failed to load: {slot.error}",
                                 code="model_load_failed")
        except BaseException:
            slot.leases -= 1
            raise
        if keep_alive != "default" and (self.router or slot is not self.default):
            slot.keep_alive = keep_alive
        return slot

    @staticmethod
    def release(slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.last_active = time.monotonic()

    def _slot_to_load(self, path: Path, arg: str) -> ModelSlot:
        """A new slot for ``path`` whose load has started on a thread (or the one already there),
        after unloading least recently used idle models beyond --models-max / --models-memory.
        Raises APIError 503 when room cannot be made."""
        with self._lock:
            slot = self.slots.get(path)
            if slot is not None:
                if path == self.default_path:
                    self.default = slot
                return slot
            slot = ModelSlot(path, arg)
            slot.keep_alive = self.keep_alive
            victims = self._make_room(slot)
            self.slots[path] = slot
            if path == self.default_path:
                self.default = slot
        for victim in victims:
            threading.Thread(target=self._unload, args=(victim,), name="edge-unload", daemon=True).start()
        threading.Thread(target=self._load, args=(slot,), name="edge-load", daemon=True).start()
        return slot

    def _make_room(self, new: ModelSlot) -> list[ModelSlot]:
        """(lock held) The idle slots to unload, least recently used first, so that ``new`` fits;
        they leave ``slots`` now. Raises APIError 503 when the busy ones leave no room."""
        held = sorted(self.slots.values(), key=lambda s: s.last_active)
        victims = []

        def over():
            kept = [s for s in held if s not in victims]
            if len(kept) + 1 > self.models_max:
                return True
            return self.memory_budget is not None and kept and \
                sum(s.bytes for s in kept) + new.bytes > self.memory_budget

        for slot in held:
            if not over():
                break
            if slot.status != "loading" and not slot.busy():
                victims.append(slot)
        if over():
            busy = len([s for s in held if s not in victims])
            raise P.APIError(503, f"cannot load {new.name!r} now: {busy} model(s) held are busy (--models-max "
                                  f"{self.models_max}, --models-memory {_gb(self.memory_budget)}); retry shortly",
                             code="models_busy", headers={"Retry-After": "5"})
        for slot in victims:
            self._remove(slot)
        return victims

    def _remove(self, slot: ModelSlot) -> None:
        """(lock held) Take ``slot`` out of the pool (its unload follows)."""
        del self.slots[slot.path]
        if slot is self.default:
            self.default = None
        self.unloaded += 1

    def _load(self, slot: ModelSlot) -> None:
        t0 = time.monotonic()
        self._on_event(f"loading {slot.name} ({slot.bytes / 1e6:.0f} MB)")
        try:
            self._load_model(slot)
            slot.status = "loaded"
            slot.loaded_at = time.time()
            self._on_event(f"loaded {slot.name} in {time.monotonic() - t0:.1f} s")
        except Exception as e:
            slot.status, slot.error = "error", f"{type(e).__name__}: {e}"
            with self._lock:
                if self.slots.get(slot.path) is slot and slot is not self.default:
                    del self.slots[slot.path]     # a later request tries again
        finally:
            slot.load_seconds = time.monotonic() - t0
            slot.last_active = time.monotonic()
            slot.ready.set()

    # ---- unloading -----------------------------------------------------------------------------

    def unload(self, model: str) -> ModelSlot:
        """Take ``model`` out of the pool now if idle, else once its requests are done (its
        keep-alive set to 0). Raises APIError 404 when it is not held."""
        slot = self.find(model)
        if slot is None:
            raise P.APIError(404, f"the model {model!r} is not loaded", param="model", code="model_not_loaded")
        slot.keep_alive = 0.0
        if not slot.busy() and slot.status != "loading":
            with self._lock:
                if self.slots.get(slot.path) is slot:
                    self._remove(slot)
            self._unload(slot)
        return slot

    def reap(self) -> list[ModelSlot]:
        """Unload the idle models whose keep-alive has passed (called every second); returns them."""
        now = time.monotonic()
        out = []
        with self._lock:
            for slot in list(self.slots.values()):
                if slot.status != "loaded":
                    continue
                if slot.busy():
                    slot.last_active = now
                    continue
                if slot.keep_alive is not None and now - slot.last_active >= slot.keep_alive:
                    self._remove(slot)
                    out.append(slot)
        for slot in out:
            self._unload(slot)
        return out

    def _unload(self, slot: ModelSlot) -> None:
        """Stop the slot's scheduler (its requests finish first) and let its memory go."""
        slot.ready.wait()
        if slot.scheduler is not None:
            slot.scheduler.stop()
            self._on_event(f"unloaded {slot.name}")
        kv = getattr(slot.engine, "kv", None)
        slot.status, slot.engine, slot.scheduler = "unloaded", None, None
        if kv is not None and hasattr(kv, "close"):
            try:
                kv.close()
            except Exception:
                pass

    def stop(self) -> None:
        """Stop every scheduler (each finishes its requests)."""
        with self._lock:
            slots = list(self.slots.values())
        for slot in slots:
            if slot.scheduler is not None:
                slot.scheduler.stop()


def _gb(n: int | None) -> str:
    return "none" if n is None else f"{n / GB:.1f} GB"
