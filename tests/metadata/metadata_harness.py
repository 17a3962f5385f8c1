"""Test plumbing for the metadata store: scratch PostgreSQL databases and an in-process server
that runs on its own event loop thread, so tests can use plain synchronous gRPC stubs."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import grpc
import psycopg2
import pytest
from psycopg2 import sql

from services.metadata.service import Settings, definition
from tests.support.inprocess import InProcessServer as BaseInProcessServer
from silod.v1 import metadata_pb2_grpc

POSTGRES_HOST = os.environ.get("SILOD_TEST_PG_HOST", "127.0.0.1")
POSTGRES_PORT = int(os.environ.get("SILOD_TEST_PG_PORT", "5432"))
POSTGRES_USER = os.environ.get("SILOD_TEST_PG_USER", "postgres")


def postgres_url(database: str) -> str:
    return f"postgresql+psycopg2://{POSTGRES_USER}@{POSTGRES_HOST}:{POSTGRES_PORT}/{database}"


class PostgresScratch:
    """Creates throw-away databases on the test PostgreSQL and drops them all at the end."""

    def __init__(self) -> None:
        self._created: list[str] = []

    @staticmethod
    def unreachable_reason() -> str | None:
        try:
            psycopg2.connect(host=POSTGRES_HOST, port=POSTGRES_PORT, user=POSTGRES_USER, dbname="postgres", connect_timeout=3).close()
        except psycopg2.Error as exc:
            return f"PostgreSQL at {POSTGRES_USER}@{POSTGRES_HOST}:{POSTGRES_PORT} is unreachable: {str(exc).strip()}"
        return None

    def _admin(self, statement: sql.Composable) -> None:
        connection = psycopg2.connect(host=POSTGRES_HOST, port=POSTGRES_PORT, user=POSTGRES_USER, dbname="postgres")
        try:
            connection.autocommit = True  # CREATE/DROP DATABASE cannot run in a transaction
            with connection.cursor() as cursor:
                cursor.execute(statement)
        finally:
            connection.close()

    def create(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        name = f"silod_test_{os.getpid()}_{secrets.token_hex(4)}"
        self._admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self._created.append(name)
        return postgres_url(name)

    def drop_all(self) -> None:
        for name in self._created:
            # FORCE ends sessions a crashed test left behind (e.g. a killed server's pool).
            self._admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self._created.clear()


class InProcessServer(BaseInProcessServer):
    """``silod metadata`` served in-process, with a MetadataService stub."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(definition(settings), settings, thread_name="metadata-server")
        self.stub = metadata_pb2_grpc.MetadataServiceStub(self.channel)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """The error ``call`` fails with; fails the test if it succeeds."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    pytest.fail("expected the call to fail, but it succeeded")


def assert_rpc_error(call: Callable[[], object], code: grpc.StatusCode, field: str | None) -> grpc.RpcError:
    """``call`` fails with ``code`` and a message that starts with ``field`` (when given)."""
    error = rpc_error(call)
    assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()}"
    if field is not None:
        assert error.details().startswith(f"{field}:"), f"message does not name {field!r}: {error.details()!r}"
    return error
