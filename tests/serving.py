"""A diffusion server in this process on 127.0.0.1:<free port>, for the server tests."""

import contextlib
import threading

import mlx_lm_diffusion as mld
from mlx_lm_diffusion import server as dserver

TIMEOUT = 120


@contextlib.contextmanager
def running_server(argv):
    """(httpd, response generator) of `mlx_lm_diffusion.server argv`, shut down after."""
    httpd, generator = dserver.start(dserver.parse_args(list(argv)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd, generator
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        thread.join(timeout=TIMEOUT)
        mld.uninstall()
