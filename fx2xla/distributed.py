"""Many processes, one global mesh: jax.distributed started the way torchrun starts PyTorch.

    # under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment)
    fx2xla.distributed.initialize()
    # any other launcher: say it
    fx2xla.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0, local_device_count=4)

Call it first, before anything starts jax's backend (a jax computation, `jax.devices()`, a call
of a function compiled by fx2xla). Then `jax.devices()` lists every process's devices (the global
mesh) and `jax.local_devices()` this process's. jax numbers process k's CPU devices from
k * 2048: with 2 processes of 4 devices each, both see ids [0, 1, 2, 3, 2048, 2049, 2050, 2051]
(process 0 owns 0-3, process 1 owns 2048-2051); a third process would own 4096 on.

Where the coordinator is: `coordinator_address=` ("host:port"), else FX2XLA_COORDINATOR_ADDRESS,
else MASTER_ADDR with the port in FX2XLA_COORDINATOR_PORT, else a port process 0 picks and
publishes through the TCPStore at MASTER_ADDR:MASTER_PORT. torchrun's agent already listens on
MASTER_PORT (it exports TORCHELASTIC_USE_AGENT_STORE=True, and its workers reach that store as
clients, which is what torch.distributed's env:// does too); without that variable, process 0
hosts the store there itself (multi-tenant, so a later `init_process_group("env://")` in the same
process shares it). The coordinator runs in process 0, so MASTER_ADDR must be process 0's host,
the same assumption torch's env:// makes.

What jax 0.10.2 does when a process of the group dies (CPU, gloo collectives), and how this module
bounds it:

- A collective waiting for a killed process does not fail by itself: gloo waits for
  `--xla_cpu_collective_timeout_seconds` (XLA's default: 1800 s), then raises a
  `jax.errors.JaxRuntimeError` ("Gloo all-reduce failed ... Connection reset by peer") in the
  waiting thread. `collective_timeout_s=` sets that flag (in XLA_FLAGS, read once when the
  backend starts; CPU collectives only). A collective already reading from the peer when it is
  killed fails at once with that error instead.
- jax's coordination service marks a process dead after `heartbeat_timeout_s` without heartbeats
  and then terminates the processes still running: a C++ fatal error (SIGABRT, exit status 134)
  whose message lists the dead task ids. When process 0 dies, the others lose the service itself
  and are terminated the same way within milliseconds. No Python exception is raised in either
  case, and jaxlib's `missed_heartbeat_callback` cannot be replaced from Python (it aborts with
  std::bad_cast).
- `init_timeout_s` bounds joining: jax terminates a process the same way (SIGABRT) about
  5 s after its `initialization_timeout` when not every process joined.
- A process that raises out of its program still runs jax's exit handler, whose shutdown barrier
  waits for the others (until one is declared dead, or `shutdown_timeout_s`), while they wait in
  a collective for it.
- jax's preemption service catches SIGTERM, so SIGTERM does not end a process of the group.

So this module keeps a watchdog: every process holds one TCP connection to process 0. A killed
or crashed process's kernel closes it at once; its peer sees it close without the goodbye that
`shutdown()` (or a normal exit) sends, and every process writes to stderr which process is gone
(its process id, host and pid) and exits with `EXIT_CODE`, within a few milliseconds. A process
whose program ends in an uncaught exception exits at once after the traceback (status 1), so the
others report it instead of waiting; where that exception is a jax runtime error (a collective
that failed as a peer died), it first gives its watchdog up to a second to see the peer go, and
then exits as above, naming it, with `EXIT_CODE`. When process 0 itself is killed, the watchdog races jax's
own termination of the others: jax logs its fatal error first and may end the process (SIGABRT)
before the watchdog's message. The watchdog cannot see a process that hangs with its socket open,
or a host that vanishes without closing it: `heartbeat_timeout_s` and `collective_timeout_s`
bound those. When joining takes longer than `init_timeout_s`, a timer ends the process before
jax does, saying whether the coordinator address answered at all, with `EXIT_CODE`.

The watchdog finds process 0's port, and `barrier()` waits, through jax's client of its
coordination service (`jax._src.distributed.global_state.client`, read in one function,
`coordination_client`). FX2XLA_PUBLIC_DISTRIBUTED=1 uses public jax only: no watchdog (jax's
heartbeat termination above is then the bound), and `barrier()` is a gather over every device
(`gather_from_processes`, bounded by the collective timeout), which returns once every local
device's part has finished.
"""
from __future__ import annotations

import atexit
import dataclasses
import math
import os
import selectors
import socket
import sys
import threading
import time
import zlib

from .errors import Fx2XlaError

# Exit status of a process that leaves because the group is broken: a peer is gone, or not every
# process joined within init_timeout_s. (EX_TEMPFAIL: torchrun's --max-restarts may retry.)
EXIT_CODE = 75

# Seconds process 0 waits, after telling the others which process is gone, for them to print it
# before it exits (its exit takes jax's coordination service down, which terminates the others).
_GRACE_S = 2.0
# Seconds a process leaving on an uncaught jax runtime error waits for its watchdog: a collective
# reading from a peer that was just killed fails at once (gloo: "Connection reset by peer"), and
# that error can reach the program before the watchdog has seen the same peer's connection close.
# The watchdog then names the peer and exits with EXIT_CODE (in milliseconds) instead of the
# process leaving with status 1 on the symptom.
_PEER_NEWS_S = 1.0


class DistributedError(Fx2XlaError):
    """The process group cannot start or a group operation failed; says which setting or
    argument is missing or wrong."""


@dataclasses.dataclass(frozen=True)
class _Request:
    """One initialize() call, resolved from its arguments and the environment."""

    coordinator_address: str | None  # None: MASTER_ADDR and a port agreed through the store
    store_address: tuple | None  # (MASTER_ADDR, MASTER_PORT) of the TCPStore that agrees the port
    num_processes: int
    process_id: int
    local_device_count: int | None
    local_device_ids: tuple | None
    init_timeout_s: int
    heartbeat_timeout_s: int
    shutdown_timeout_s: int
    collective_timeout_s: int | None
    watchdog: bool


class _State:
    request: _Request | None = None
    store = None  # the TCPStore that agreed the port; process 0 may be hosting it
    watchdog: _Watchdog | None = None
    hooks_installed = False
    uncaught_exception: BaseException | None = None


_state = _State()


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None,
               local_device_ids=None, init_timeout_s: float = 300, heartbeat_timeout_s: float = 100,
               shutdown_timeout_s: float = 300, collective_timeout_s: float | None = None,
               watchdog: bool = True) -> None:
    """Join this process to the group: starts jax.distributed, and process 0 the coordinator.

    Without arguments it reads torchrun's WORLD_SIZE (num_processes), RANK (process_id),
    LOCAL_RANK (local_device_ids=[LOCAL_RANK]: one accelerator per process, torchrun's convention;
    CPU devices are unaffected) and MASTER_ADDR/MASTER_PORT (the coordinator, see the module
    doc). `local_device_count`: this process's CPU devices (jax_num_cpu_devices). Timeouts in
    seconds: `init_timeout_s` for every process to join, `heartbeat_timeout_s` before jax declares
    a silent process dead, `shutdown_timeout_s` for the exit barrier, `collective_timeout_s` for a
    CPU collective (None: XLA's 1800 s). `watchdog`: exit at once, naming it, when a peer is gone.

    A second call with the same arguments does nothing; with others it raises DistributedError.
    """
    request = _resolve(coordinator_address, num_processes, process_id, local_device_count,
                       local_device_ids, init_timeout_s, heartbeat_timeout_s, shutdown_timeout_s,
                       collective_timeout_s, watchdog)
    if _state.request is not None:
        if request == _state.request:
            return
        changed = ", ".join(f"{f.name}={getattr(_state.request, f.name)!r} (now {getattr(request, f.name)!r})"
                            for f in dataclasses.fields(_Request)
                            if getattr(_state.request, f.name) != getattr(request, f.name))
        raise DistributedError(f"fx2xla.distributed is already initialized as process {_state.request.process_id} of "
                               f"{_state.request.num_processes}; this call differs in {changed}. A process joins one "
                               "group: call initialize() once, or again with the same arguments.")
    import jax

    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed was already initialized by a direct jax.distributed.initialize() "
                               "call; call fx2xla.distributed.initialize() instead of it, not after it")
    try:
        if request.local_device_count is not None:
            jax.config.update("jax_num_cpu_devices", request.local_device_count)
    except RuntimeError as e:
        raise _too_late(e) from e

    address, store = request.coordinator_address, None
    if address is None:
        host, store_port = request.store_address
        port, store = agree_port(host, store_port, request.process_id, request.num_processes,
                                 request.init_timeout_s)
        address = _join_host_port(host, port)

    # jax terminates the process (SIGABRT) when joining times out; the timer speaks first.
    deadline = threading.Timer(request.init_timeout_s, _join_timed_out, (request, address))
    deadline.daemon = True
    deadline.start()
    try:
        try:
            jax.distributed.initialize(
                address, request.num_processes, request.process_id,
                local_device_ids=list(request.local_device_ids) if request.local_device_ids is not None else None,
                cluster_detection_method="deactivate",  # every parameter is resolved above
                initialization_timeout=request.init_timeout_s,
                heartbeat_timeout_seconds=request.heartbeat_timeout_s,
                shutdown_timeout_seconds=request.shutdown_timeout_s)
        except RuntimeError as e:
            if "before" in str(e) and "backend" in str(e):
                raise _too_late(e) from e
            raise DistributedError(f"jax.distributed.initialize({address!r}, num_processes={request.num_processes}, "
                                   f"process_id={request.process_id}) failed: {e}") from e
        # XLA reads its flags once, when the backend starts: after jax.distributed, which does not start it.
        if request.collective_timeout_s is not None:
            _set_xla_flag("xla_cpu_collective_timeout_seconds", request.collective_timeout_s)
        _state.request, _state.store = request, store
        if not _state.hooks_installed:
            _state.hooks_installed = True
            # Registered after jax's own exit handler (jax registers it when imported), so it runs first.
            atexit.register(_at_exit)
            sys.excepthook = _noting_uncaught(sys.excepthook)
        client = coordination_client()
        if request.watchdog and request.num_processes > 1 and client is not None:
            dog = _Watchdog(request.process_id, request.num_processes)
            try:
                dog.start(client, _split_host_port(address)[0], request.init_timeout_s)
            except Exception as e:
                raise DistributedError(f"process {request.process_id}: the watchdog could not connect to process 0 "
                                       f"({e}); jax.distributed is running without it (watchdog=False skips it)") from e
            _state.watchdog = dog
    finally:
        deadline.cancel()


def shutdown() -> None:
    """Leave the group: say goodbye to the watchdog peers, then jax.distributed.shutdown(), which
    waits (up to shutdown_timeout_s) for every process to arrive. A normal exit does the same on
    its own (the second part in jax's exit handler). Nothing to do when not initialized."""
    if _state.watchdog is not None:
        _state.watchdog.stop()
    import jax

    jax.distributed.shutdown()
    _state.request = _state.store = _state.watchdog = None


def group_settings() -> dict | None:
    """The settings initialize() resolved for this process's group (coordinator and store
    addresses, process count and id, local devices, timeouts, watchdog), or None where it has not
    run here (or shutdown() left the group)."""
    return None if _state.request is None else dataclasses.asdict(_state.request)


def is_initialized() -> bool:
    """Whether jax.distributed is running in this process (started here or by jax directly)."""
    import jax

    return jax.distributed.is_initialized()


def process_index() -> int:
    """This process's id in the group (0 when alone). Reads the group's settings when initialized;
    otherwise asks jax, which starts its backend."""
    if _state.request is not None:
        return _state.request.process_id
    import jax

    return jax.process_index()


def process_count() -> int:
    """How many processes the group has (1 when alone); see process_index about the backend."""
    if _state.request is not None:
        return _state.request.num_processes
    import jax

    return jax.process_count()


def local_devices() -> list:
    """This process's jax devices (`jax.devices()` lists every process's)."""
    import jax

    return jax.local_devices()


def barrier(name: str, timeout_s: float = 300) -> None:
    """Wait until every process of the group reaches the barrier `name` (a name can be used again
    once every process passed it). Raises DistributedError when not all arrive within
    `timeout_s`. In public mode it is a collective over every device, bounded by the collective
    timeout instead."""
    client = coordination_client()
    if client is None:
        import numpy as np

        rows = gather_from_processes(np.array([zlib.crc32(name.encode())], np.uint32))
        if (rows != rows[0]).any():
            raise DistributedError(f"barrier {name!r}: the processes arrived at differently named barriers "
                                   f"(name checksums by process: {rows[:, 0].tolist()})")
        return
    try:
        client.wait_at_barrier(f"fx2xla/barrier/{name}", max(1, int(timeout_s * 1000)))
    except Exception as e:
        raise DistributedError(f"barrier {name!r}: not every one of the {process_count()} processes arrived "
                               f"within {timeout_s} s\n  jax: {e}") from e


class ProcessShare:
    """`share(key, text) -> text`: process 0's `text` in every process (the others pass None).
    Through jax's coordination service (a key-value store; `key` names the value), or in public
    mode by a broadcast collective over every device, which every process then calls in the
    same order. `decides`: whether this is process 0."""

    # How long the other processes wait for process 0's value: it may be compiling graphs before
    # this one, as each of them did.
    timeout_ms = 600_000

    def __init__(self, index: int, client):
        self.decides = index == 0
        self._client = client

    def __call__(self, key: str, text: str | None) -> str:
        if self._client is None:
            return _broadcast_from_process_0(text)
        if not self.decides:
            return self._client.blocking_key_value_get(key, self.timeout_ms)
        try:
            self._client.key_value_set(key, text)
        except Exception:  # noqa: BLE001  set before (this process forgot it had): the same value
            pass
        return text


def process_share() -> ProcessShare | None:
    """How process 0's decisions reach the others (auto-sharding's plans): None in a single
    process."""
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() < 2:
        return None
    return ProcessShare(jax.process_index(), coordination_client())


def _broadcast_from_process_0(text: str | None) -> str:
    """Public jax only: process 0's `text` in every process, by two gathers over every device (its
    length, then its bytes). Every process calls it, in the same order."""
    import numpy as np

    data = np.frombuffer(text.encode(), np.uint8) if text is not None else np.zeros(0, np.uint8)
    n = int(gather_from_processes(np.array([len(data)], np.int32))[0, 0])
    buf = data if text is not None else np.zeros(n, np.uint8)
    return bytes(gather_from_processes(buf)[0]).decode()


def gather_from_processes(row):
    """Every process's `row` (a numpy array of one shape in every process), stacked in process
    order, by an all-gather over every device of the group (public jax only). Returns once every
    local device's gather has finished (see `runtime.handoff.gather_whole`): jax's
    `sync_global_devices` and `broadcast_one_to_all` do not wait for them."""
    import jax
    import numpy as np

    from .runtime.handoff import gather_whole

    row = np.asarray(row)
    if jax.dtypes.canonicalize_dtype(row.dtype) != row.dtype:
        raise ValueError(f"gather_from_processes: jax would narrow this {row.dtype} row to "
                         f"{jax.dtypes.canonicalize_dtype(row.dtype)} (jax_enable_x64 is off); pass that dtype")
    n, local = jax.process_count(), jax.local_device_count()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n, local), ("processes", "local"))
    stacked = jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("processes")), row[None], (n, *row.shape))
    return gather_whole(stacked)


def coordination_client(public: bool | None = None):
    """jax's client of its coordination service (key-value store, barriers), or None: in public
    mode (`public`, else FX2XLA_PUBLIC_DISTRIBUTED=1), before jax.distributed starts, or where
    this jax keeps no such client. The only private jax name this module reads."""
    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_DISTRIBUTED", "") not in ("", "0")
    if public:
        return None
    try:
        from jax._src.distributed import global_state
    except ImportError:
        return None
    client = getattr(global_state, "client", None)
    needed = ("key_value_set", "blocking_key_value_get", "wait_at_barrier")
    return client if client is not None and all(hasattr(client, m) for m in needed) else None


# --- settings --------------------------------------------------------------------------------

def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def _seconds(name: str, value) -> int:
    """jax takes whole seconds; a fraction rounds up so a bound is never shortened."""
    if value is None or not value > 0:
        raise DistributedError(f"{name}={value!r}: give a positive number of seconds")
    return math.ceil(value)


def _resolve(coordinator_address, num_processes, process_id, local_device_count, local_device_ids,
             init_timeout_s, heartbeat_timeout_s, shutdown_timeout_s, collective_timeout_s,
             watchdog) -> _Request:
    """The request, from the arguments, else torchrun's environment; raises before anything starts."""
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    n_name = "num_processes" if num_processes is not None else "WORLD_SIZE"
    id_name = "process_id" if process_id is not None else "RANK"
    n = num_processes if num_processes is not None else world
    pid = process_id if process_id is not None else rank
    if n is None and pid is None:
        raise DistributedError("no process group given: pass num_processes= and process_id= (and "
                               "coordinator_address=), or start the program with torchrun, which sets WORLD_SIZE "
                               "and RANK")
    if pid is None:
        raise DistributedError(f"{n_name}={n} but RANK is unset: pass process_id= or set RANK (torchrun sets both)")
    if n is None:
        raise DistributedError(f"{id_name}={pid} but WORLD_SIZE is unset: pass num_processes= or set WORLD_SIZE "
                               "(torchrun sets both)")
    if not isinstance(n, int) or not isinstance(pid, int) or n < 1 or not 0 <= pid < n:
        raise DistributedError(f"{id_name}={pid!r} with {n_name}={n!r}: need 0 <= {id_name} < {n_name}")

    store_address = None
    address = coordinator_address or os.environ.get("FX2XLA_COORDINATOR_ADDRESS") or None
    if address is not None:
        source = "coordinator_address" if coordinator_address else "FX2XLA_COORDINATOR_ADDRESS"
        try:
            host, port = _split_host_port(address)
        except ValueError:
            raise DistributedError(f"{source}={address!r} is not 'host:port'") from None
        address = _join_host_port(host, port)
    else:
        host = os.environ.get("MASTER_ADDR", "").strip()
        if not host:
            raise DistributedError("no coordinator address: pass coordinator_address='host:port', set "
                                   "FX2XLA_COORDINATOR_ADDRESS=host:port, or set MASTER_ADDR and MASTER_PORT "
                                   "(torchrun sets them)")
        port = _env_int("FX2XLA_COORDINATOR_PORT")
        if port is not None:
            address = _join_host_port(host, port)
        else:
            master_port = _env_int("MASTER_PORT")
            if master_port is None:
                raise DistributedError(f"MASTER_ADDR={host} but MASTER_PORT is unset: set MASTER_PORT (torchrun does; "
                                       "the coordinator's port is agreed through the store there) or "
                                       "FX2XLA_COORDINATOR_PORT (the same in every process)")
            store_address = (host, master_port)

    if local_device_ids is None:
        local_rank = _env_int("LOCAL_RANK")
        local_device_ids = None if local_rank is None else (local_rank,)
    elif isinstance(local_device_ids, int):
        local_device_ids = (local_device_ids,)
    else:
        local_device_ids = tuple(int(i) for i in local_device_ids)
    if local_device_count is not None and (not isinstance(local_device_count, int) or local_device_count < 1):
        raise DistributedError(f"local_device_count={local_device_count!r}: give a positive integer")
    return _Request(
        address, store_address, n, pid, local_device_count, local_device_ids,
        _seconds("init_timeout_s", init_timeout_s), _seconds("heartbeat_timeout_s", heartbeat_timeout_s),
        _seconds("shutdown_timeout_s", shutdown_timeout_s),
        None if collective_timeout_s is None else _seconds("collective_timeout_s", collective_timeout_s),
        bool(watchdog))


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(address)
    return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _set_xla_flag(name: str, value) -> None:
    """Put --name=value into XLA_FLAGS, replacing a setting of the same flag."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(f"--{name}=")]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"--{name}={value}"])


def _too_late(cause: BaseException) -> DistributedError:
    return DistributedError("fx2xla.distributed.initialize() must run before jax's backend starts (any jax "
                            "computation, jax.devices(), or a call of a function compiled by fx2xla starts it): "
                            f"call it first, right after the imports.\n  jax: {cause}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def agree_port(host: str, store_port: int, process_id: int, num_processes: int, timeout_s: float,
               agent_store: bool | None = None):
    """(coordinator port, store): process 0 picks a free port and publishes it in the TCPStore at
    host:store_port; the others read it (waiting up to `timeout_s`). `agent_store` (default:
    TORCHELASTIC_USE_AGENT_STORE=True, torchrun's mark): the store is torchrun's agent's, so every
    process is a client; otherwise process 0 hosts it. The port is free when picked and bound by
    jax's coordinator moments later."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    if agent_store is None:
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = process_id == 0 and not agent_store
    where = f"MASTER_ADDR:MASTER_PORT={_join_host_port(host, store_port)}"
    try:
        store = TCPStore(host, store_port, num_processes, is_master=hosting, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True)
    except Exception as e:
        raise DistributedError(f"cannot {'host' if hosting else 'reach'} the TCPStore at {where} within {timeout_s} s "
                               f"to agree on the coordinator's port: {e}\n  Set FX2XLA_COORDINATOR_PORT (the same "
                               "free port in every process) to do without it.") from e
    # One key per run and restart: a restarted group never reads an earlier attempt's port.
    key = (f"fx2xla/coordinator_port/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if process_id == 0:
        port = _free_port()
        store.set(key, str(port))
        return port, store
    try:
        return int(store.get(key)), store
    except Exception as e:
        raise DistributedError(f"process 0 published no coordinator port in the TCPStore at {where} within "
                               f"{timeout_s} s (is it running, with the same MASTER_ADDR and MASTER_PORT?): {e}") from e


# --- failure handling ------------------------------------------------------------------------

def _write_stderr(message: str) -> None:
    """Flush what the program printed, then write `message` unbuffered (the process ends next)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.write(2, message.encode(errors="replace"))


def _die(message: str, code: int) -> None:
    """End the process now: a thread blocked inside XLA cannot be interrupted, and a normal exit
    would wait in jax's shutdown barrier for the missing process."""
    _write_stderr(message)
    os._exit(code)


def _join_timed_out(request: _Request, address: str) -> None:
    me = f"process {request.process_id} of {request.num_processes} (host {socket.gethostname()}, pid {os.getpid()})"
    if request.process_id == 0:
        why = (f"not every one of the {request.num_processes} processes joined the coordinator this process runs "
               f"at {address}")
    else:
        try:
            socket.create_connection(_split_host_port(address), timeout=1).close()
            why = (f"the coordinator at {address} is up, but not every one of the {request.num_processes} processes "
                   "joined it")
        except OSError:
            why = (f"nothing answers at the coordinator address {address}: process 0 has not started it, or the "
                   "address is wrong")
    _die(f"fx2xla.distributed: {me} could not join the group within init_timeout_s={request.init_timeout_s}: {why}. "
         f"Exiting with code {EXIT_CODE}.\n", EXIT_CODE)


def _noting_uncaught(previous):
    def excepthook(*exc_info):
        _state.uncaught_exception = exc_info[1]
        previous(*exc_info)

    return excepthook


def _at_exit() -> None:
    if _state.request is None:
        return
    if _state.uncaught_exception is not None and _state.request.num_processes > 1:
        # jax's exit handler would wait in its shutdown barrier for peers that wait for this one.
        if _state.watchdog is not None:
            import jax

            if isinstance(_state.uncaught_exception, jax.errors.JaxRuntimeError):
                _state.watchdog.await_peer_news(_PEER_NEWS_S)
            _state.watchdog.leave_on_error()
        _die("", 1)
    if _state.watchdog is not None:
        _state.watchdog.stop()
    # jax's own exit handler, which runs next, clears the backends and then shuts the
    # distributed client down, in that order.


class _Watchdog:
    """Peer liveness over plain TCP, a star around process 0: every other process holds one
    connection to it and sends `hello <id> <host> <pid>`. A connection that closes without `bye`
    means that process is gone: process 0 sends `dead <id> <host> <pid>` to the others, and every
    process reports it and exits. Process 0's connection closing without `bye` means process 0 is
    gone. Process 0's sockets are used by its serving thread only; other threads wake it."""

    def __init__(self, process_id: int, num_processes: int):
        self.me = (process_id, socket.gethostname(), os.getpid())
        self.n = num_processes
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._peers: dict = {}  # process 0: socket -> _Peer
        self._sock = None  # the others: the connection to process 0
        self._coordinator = None  # (0, host, pid)
        self._thread = None

    def start(self, client, coordinator_host: str, timeout_s: int) -> None:
        key = "fx2xla/watchdog"
        if self.me[0] == 0:
            server = (socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
                      if socket.has_dualstack_ipv6() else socket.create_server(("", 0)))
            client.key_value_set(key, f"{server.getsockname()[1]} {self.me[1]} {self.me[2]}")
            run, args = self._serve, (server,)
        else:
            port, host0, pid0 = client.blocking_key_value_get(key, timeout_s * 1000).split()
            self._coordinator = (0, host0, int(pid0))
            self._sock = socket.create_connection((coordinator_host, int(port)), timeout=timeout_s)
            self._sock.settimeout(None)
            self._sock.sendall(("hello %d %s %d\n" % self.me).encode())
            run, args = self._watch_coordinator, ()
        self._thread = threading.Thread(target=run, args=args, name="fx2xla-distributed-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Say goodbye: from now on this process leaving is not a failure."""
        self._stopping = True
        if self._sock is not None:
            try:
                self._sock.sendall(b"bye\n")
                self._sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        else:
            self._wake(b"s")

    def await_peer_news(self, seconds: float) -> None:
        """Give the watchdog thread `seconds` to see a peer's connection close: it reports that
        process and ends this one with EXIT_CODE (os._exit), so this returns only if no peer is
        gone (or process 0 said goodbye meanwhile)."""
        if self._thread is not None:
            self._thread.join(seconds)

    def leave_on_error(self) -> None:
        """This process is exiting on an uncaught exception: process 0 tells the others first
        (a process other than 0 just leaves; process 0 sees its connection close)."""
        self._stopping = True
        if self._sock is None:
            self._wake(b"e")

    def _wake(self, command: bytes) -> None:
        try:
            self._wake_w.send(command)
        except OSError:
            return
        if self._thread is not None:
            self._thread.join(_GRACE_S + 1)

    # process 0

    def _serve(self, server) -> None:
        sel = selectors.DefaultSelector()
        sel.register(server, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                sock = key.fileobj
                if sock is self._wake_r:
                    if self._wake_r.recv(1) == b"e":
                        self._broadcast_dead(self.me)
                    else:
                        self._broadcast(b"bye\n")
                    for peer in self._peers:
                        peer.close()
                    server.close()
                    return
                if sock is server:
                    conn, _ = server.accept()
                    sel.register(conn, selectors.EVENT_READ)
                    self._peers[conn] = _Peer()
                    continue
                peer = self._peers[sock]
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if data:
                    peer.feed(data)
                    continue
                sel.unregister(sock)
                sock.close()
                del self._peers[sock]
                # A connection that never said hello is not one of the group's processes.
                if peer.ident is not None and not peer.said_bye and not self._stopping:
                    self._report(peer.ident, reporter=None)
                    self._broadcast_dead(peer.ident)
                    os._exit(EXIT_CODE)

    def _broadcast(self, line: bytes) -> None:
        for peer in self._peers:
            try:
                peer.sendall(line)
            except OSError:
                pass

    def _broadcast_dead(self, ident) -> None:
        """Send `dead` to every connected process, then wait up to _GRACE_S for them to close
        (each exits on it): their reports then come before jax notices that process 0 is gone."""
        self._broadcast(("dead %d %s %d\n" % ident).encode())
        end = time.monotonic() + _GRACE_S
        for peer in self._peers:
            try:
                peer.settimeout(max(0.001, end - time.monotonic()))
                while peer.recv(4096):
                    pass
            except OSError:
                pass

    # the other processes

    def _watch_coordinator(self) -> None:
        buffer, said_bye = b"", False
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                words = line.decode(errors="replace").split()
                if words[:1] == ["bye"]:
                    said_bye = True
                elif words[:1] == ["dead"] and len(words) == 4:
                    self._report((int(words[1]), words[2], int(words[3])), reporter=self._coordinator)
                    os._exit(EXIT_CODE)
        if not said_bye and not self._stopping:
            self._report(self._coordinator, reporter=None)
            os._exit(EXIT_CODE)

    def _report(self, ident, reporter) -> None:
        pid, host, os_pid = ident
        seen = ("" if reporter is None or reporter[0] == pid
                else f" (seen by process {reporter[0]} on host {reporter[1]})")
        _write_stderr(
            f"fx2xla.distributed: process {pid} of {self.n} (host {host}, pid {os_pid}) is gone{seen}: it closed "
            "its connection without shutting down (killed, crashed, or ended on an error). Every collective "
            f"with it would wait, so process {self.me[0]} (host {self.me[1]}, pid {self.me[2]}) exits now "
            f"with code {EXIT_CODE}.\n")


class _Peer:
    """Process 0's view of one connection: who it is and whether it said goodbye."""

    def __init__(self):
        self.buffer = b""
        self.ident = None
        self.said_bye = False

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            words = line.decode(errors="replace").split()
            if words[:1] == ["hello"] and len(words) == 4:
                self.ident = (int(words[1]), words[2], int(words[3]))
            elif words[:1] == ["bye"]:
                self.said_bye = True
