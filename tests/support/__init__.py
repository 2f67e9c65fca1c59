"""Helpers every test tier shares, and the GPU and VM payloads too (which run without
pytest): standard library only, and nothing from `agent`, so that they import the same
on a bare host, in the container and in the VM.

    net        free ports, whether a port accepts, HTTP requests through http.client
    rawhttp    a raw HTTP/1.1 client and request reader of the tests' own (not the product's
               parser), for byte-exact and pipelined exchanges
    serve      the `providerctl serve` harness: a foreground agent as a subprocess, its log
    paths      ROOT (the checkout) and the tests' own folders

Import them as `from support.net import free_port` (tests/ is on sys.path under pytest;
tests/gpu/runner.py puts it there; the VM payload carries a copy beside run_tests.py).
"""
