"""What tests that start their own processes on localhost share: a free port, and
whether this jaxlib can run CPU collectives across processes (gloo)."""

import socket


def gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:  # pragma: no cover - other jaxlib layouts
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
