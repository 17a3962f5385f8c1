"""The tests' free-port helper never hands out one port twice in a row (a CI run's second
scheduler was given the port the first one's metrics server then bound)."""

from tests.support.procs import free_port


def test_free_port_answers_differ_call_after_call() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
