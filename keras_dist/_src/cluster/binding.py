"""Which network interface a job's coordination endpoints listen on.

The rule, on every backend: a job whose addresses are all loopback
(``127.0.0.0/8``, ``localhost``, ``::1``) listens on loopback only; a job
over several hosts listens on the address it was given (``MASTER_ADDR``,
TF_CONFIG's); ``KERAS_DIST_BIND_ALL=1`` listens on every interface (what
the engines do by default, for jobs behind NAT or with a coordinator
address that is not an address of this host).

What listens, where (see guides/multi_worker.md, "Security"):

- JAX: rank 0's coordination service (``jax.distributed``), through its
  ``coordinator_bind_address``.
- torch: rank 0's rendezvous ``TCPStore``; keras_dist opens its listening
  socket itself and hands it to the store. gloo's pair sockets listen on
  the address the store's host resolves to.
- TensorFlow: every worker's gRPC server (collectives and rank 0's
  coordination service). TensorFlow binds it to ``0.0.0.0:port`` in C++
  (``GrpcServer::Init`` in grpc_server_lib.cc) and offers no setting to
  change that: a TensorFlow job listens on every interface.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from keras_dist._src.errors import KerasDistError

ENV_BIND_ALL = "KERAS_DIST_BIND_ALL"
LOOPBACK = "127.0.0.1"


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo``, ``lo0``), or
    None when this host lists none of those names."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def bind_all_requested() -> bool:
    """Whether ``KERAS_DIST_BIND_ALL`` asks for every interface.

    Raises:
        ValueError: for a value other than 0/1, true/false, yes/no.
    """
    value = os.environ.get(ENV_BIND_ALL, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(
        f"{ENV_BIND_ALL}={value!r} is not understood; set it to 1 to listen "
        "on every interface, or unset it to listen on the job's address."
    )


def _addresses(host: str) -> list[str]:
    """The IP addresses `host` stands for (itself when it is one)."""
    host = host.strip("[]")
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    if host.lower() == "localhost":
        return ["127.0.0.1"]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return sorted({info[4][0].split("%")[0] for info in infos})


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) names this host's loopback
    interface only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    addresses = _addresses(host)
    return bool(addresses) and all(
        ipaddress.ip_address(a).is_loopback for a in addresses
    )


def _host_of(address: str) -> str:
    host, sep, port = address.rpartition(":")
    return host.strip("[]") if sep and port.isdigit() else address


def bind_host(environment) -> str | None:
    """The address this job's endpoints listen on; None: every interface.

    Args:
        environment: the job's `ClusterEnvironment` (its coordinator host,
            the workers' addresses, and whether it spans several hosts).

    Returns:
        A loopback address for a job whose addresses are all loopback; the
        coordinator's address as given for a job over several hosts; None
        with ``KERAS_DIST_BIND_ALL=1``, or when the given name resolves
        here to loopback while the job spans several hosts (Debian maps
        the host name to ``127.0.1.1``): loopback would shut the other
        hosts out.
    """
    if bind_all_requested():
        return None
    host = environment.coordinator_host
    if host is None:
        return LOOPBACK
    hosts = [host] + [_host_of(a) for a in environment.worker_addresses]
    several_hosts = environment.local_world_size < environment.world_size
    if all(is_loopback(h) for h in hosts):
        if several_hosts:
            return None
        address = _addresses(host)[0]
        return address
    return host.strip("[]")


def format_address(host: str | None, port: int) -> str:
    """``"host:port"``, with IPv6 hosts in brackets; ``"[::]:port"`` (every
    interface) for None."""
    if host is None:
        return f"[::]:{port}"
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def listen_socket(host: str | None, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` (None: every interface).

    Raises:
        KerasDistError: when the address cannot be bound here (not an
            address of this host, or the port is taken), saying what to do.
    """
    try:
        if host is None:
            if socket.has_dualstack_ipv6():
                return socket.create_server(
                    ("", port),
                    family=socket.AF_INET6,
                    dualstack_ipv6=True,
                    backlog=128,
                )
            return socket.create_server(("", port), backlog=128)
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        family, _, _, _, address = infos[0]
        return socket.create_server(address, family=family, backlog=128)
    except OSError as error:
        where = format_address(host, port)
        raise KerasDistError(
            f"keras_dist cannot listen on {where} for the job's rendezvous: "
            f"{error}. The coordinator address must be an address of rank "
            "0's host and the port free; to listen on every interface "
            f"instead, set {ENV_BIND_ALL}=1."
        ) from None


_TF_SERVER = "TensorFlow gRPC server ({what}) on 0.0.0.0:{port}"
_TF_NOTE = (
    "TensorFlow binds its servers to every interface (in C++) and has no "
    "setting for it"
)


def endpoints(backend: str, environment, processes: int = 1) -> list[str]:
    """What a job of `environment` listens on, and where: one line each.

    Args:
        backend: ``"jax"``, ``"tensorflow"`` or ``"torch"``.
        environment: the job's `ClusterEnvironment` (a one-process one for
            a job not started by a launcher).
        processes: the processes a strategy would start here (torch's
            ``MirroredStrategy`` without a launcher: one per device).

    Returns:
        Empty when nothing listens (one process).
    """
    if environment.is_distributed:
        host = bind_host(environment)
        port = environment.coordinator_port
    elif backend == "torch" and processes > 1:
        host = None if bind_all_requested() else LOOPBACK
        port = "<free port>"
    else:
        return []
    where = "every interface" if host is None else host
    store = format_address(host, port) if host else f"every interface:{port}"
    local = host is not None and is_loopback(host)
    lines = []
    if backend == "jax":
        lines.append(f"rank 0: JAX coordination service on {store}")
        lines.append(
            "every worker (CPU): gloo collectives on "
            + (where if local else "the address this host's name resolves to")
            + ", random ports"
        )
    elif backend == "torch":
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            lines.append(
                "torchrun's agent: rendezvous store on MASTER_PORT "
                "(torchrun binds it, every interface)"
            )
        else:
            lines.append(f"rank 0: rendezvous store (TCPStore) on {store}")
        lines.append(
            "every rank: gloo (CPU) on "
            + (where if local else "the address this host's name resolves to")
            + ", random ports; NCCL (GPU) on the interface NCCL picks "
            "(NCCL_SOCKET_IFNAME)"
        )
    elif backend == "tensorflow":
        for rank, address in enumerate(environment.worker_addresses):
            what = "collectives, coordination service" * (rank == 0)
            lines.append(
                f"rank {rank}: "
                + _TF_SERVER.format(
                    what=what or "collectives", port=address.rsplit(":")[-1]
                )
            )
        if not environment.worker_addresses:
            lines.append(
                "every worker: "
                + _TF_SERVER.format(what="collectives", port="<port>")
            )
        lines.append(_TF_NOTE)
    return lines
