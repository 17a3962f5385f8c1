"""Datasets and their manifests. A registration writes the whole manifest in one transaction,
so readers see either the old manifest or the new one, never a mix.

A dataset belongs to a tenant (spec.tenant; empty on registration: "default", for the admins that
name none; the access table fills in a user's). A replacement keeps the tenant, refused here for
every caller when it names another: who may register or replace which dataset is the access
table's rule (services/runtime/access_rules.py), this is the store's guard against a replacement
racing a registration. ``shared`` datasets are readable by every tenant; a replacement may share a
dataset, never unshare it (so that other tenants' jobs keep reading it)."""

from __future__ import annotations

import csv
import io

from sqlalchemy import Connection, delete, insert, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from silod.v1 import common_pb2

from services.metadata import convert, paging
from services.metadata.clock import utc_now
from services.metadata.database import Database
from services.metadata.models import Dataset, DatasetObject, Job
from services.metadata.validation.common import check_identifier
from silod.rpc.identifiers import DATASET_NAME
from services.metadata.validation.datasets import Manifest, check_dataset_spec
from services.metadata.validation.jobs import DEFAULT_TENANT
from services.runtime.errors import AlreadyExists, FailedPrecondition, NotFound

# Rows per batch: bounds the memory of one batch's parameters (or CSV text) while
# amortizing round trips.
_INSERT_BATCH = 20000
_COPY_OBJECTS = (
    "COPY dataset_objects (dataset_name, manifest_version, key, size_bytes, etag) FROM STDIN WITH (FORMAT csv)"
)


class DatasetStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def check_registrable(self, spec: common_pb2.DatasetSpec, replace: bool) -> None:
        """Fail fast, before a client streams a large manifest that would be refused anyway."""
        check_dataset_spec(spec)
        with self._db.read() as session:
            row = session.get(Dataset, spec.name)
            if row is not None:
                _check_replacement(row, spec, replace)

    def register(self, spec: common_pb2.DatasetSpec, manifest: Manifest, *, replace: bool) -> common_pb2.Dataset:
        check_dataset_spec(spec)
        try:
            return self._register_once(spec, manifest, replace)
        except IntegrityError:
            # Another stream created the same name between our read and our insert.
            if not replace:
                raise _already_exists(spec.name) from None
        return self._register_once(spec, manifest, replace)  # now it exists: replace it

    def _register_once(self, spec: common_pb2.DatasetSpec, manifest: Manifest, replace: bool) -> common_pb2.Dataset:
        with self._db.write() as session:
            return convert.dataset_to_proto(self._write(session, spec, manifest, replace))

    def get(self, name: str) -> common_pb2.Dataset:
        check_identifier(name, DATASET_NAME, "name")
        with self._db.read() as session:
            return convert.dataset_to_proto(_load(session, name))

    def owner(self, name: str) -> tuple[str, bool] | None:
        """(tenant, shared) of dataset ``name``; None when there is none (services/runtime/directory.py)."""
        with self._db.read() as session:
            row = session.execute(select(Dataset.tenant, Dataset.shared).where(Dataset.name == name)).one_or_none()
        return None if row is None else (row.tenant, bool(row.shared))

    def job_dataset(self, job_id: str) -> str | None:
        """The dataset job ``job_id`` names ("" for none); None when there is no such job."""
        with self._db.read() as session:
            spec = session.scalar(select(Job.spec).where(Job.id == job_id))
        return None if spec is None else convert.from_json(spec, common_pb2.JobSpec).dataset

    def list(self, page_size: int = 0, page_token: str = "", tenant: str = "") -> tuple[list[common_pb2.Dataset], str]:
        """One page by name; with ``tenant``, the datasets it may read: its own and the shared ones."""
        size = paging.DATASETS.size(page_size)
        after = paging.decode_token(page_token, "datasets", str)
        query = select(Dataset).order_by(Dataset.name).limit(size + 1)
        if tenant:
            query = query.where(or_(Dataset.tenant == tenant, Dataset.shared.is_(True)))
        if after:
            query = query.where(Dataset.name > after[0])
        with self._db.read() as session:
            rows = list(session.scalars(query))
        page = rows[:size]
        next_token = paging.encode_token("datasets", page[-1].name) if len(rows) > size else ""
        return [convert.dataset_to_proto(row) for row in page], next_token

    def list_objects(
        self, name: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[common_pb2.DatasetObject], str, int]:
        """One page of the current manifest ordered by key, the next token, and the manifest version."""
        check_identifier(name, DATASET_NAME, "name")
        size = paging.DATASET_OBJECTS.size(page_size)
        after = paging.decode_token(page_token, "dataset-objects", str, int, str)
        with self._db.read() as session:
            dataset = _load(session, name)
            version = dataset.manifest_version
            query = (
                select(DatasetObject.key, DatasetObject.size_bytes, DatasetObject.etag)
                .where(DatasetObject.dataset_name == name, DatasetObject.manifest_version == version)
                .order_by(DatasetObject.key)
                .limit(size + 1)
            )
            if after:
                token_name, token_version, last_key = after
                if token_name != name:
                    raise FailedPrecondition(f"token was issued for dataset {token_name!r}", field="page_token")
                if token_version != version:
                    raise FailedPrecondition(
                        f"manifest was replaced (version {token_version} -> {version}); restart the listing",
                        field="page_token",
                    )
                query = query.where(DatasetObject.key > last_key)
            rows = session.execute(query).all()
        page = rows[:size]
        next_token = paging.encode_token("dataset-objects", name, version, page[-1].key) if len(rows) > size else ""
        objects = [common_pb2.DatasetObject(key=key, size_bytes=size_bytes, etag=etag) for key, size_bytes, etag in page]
        return objects, next_token, version

    @staticmethod
    def _write(session: Session, spec: common_pb2.DatasetSpec, manifest: Manifest, replace: bool) -> Dataset:
        now = utc_now()
        # FOR UPDATE serializes concurrent replacements on PostgreSQL (SQLite: one writer anyway).
        row = session.scalars(select(Dataset).where(Dataset.name == spec.name).with_for_update()).one_or_none()
        if row is None:
            row = Dataset(name=spec.name, manifest_version=1, registered_at=now, tenant=spec.tenant or DEFAULT_TENANT,
                          shared=spec.shared)
            session.add(row)
        else:
            _check_replacement(row, spec, replace)
            row.manifest_version += 1
            row.shared = row.shared or spec.shared
        row.uri = spec.uri
        row.storage_options = dict(spec.storage_options)
        row.description = spec.description
        row.num_objects = len(manifest)
        row.total_bytes = manifest.total_bytes
        row.updated_at = now
        session.flush()

        table = DatasetObject.__table__
        connection = session.connection()
        version = row.manifest_version
        _insert_manifest(connection, spec.name, version, manifest)
        if version > 1:
            connection.execute(
                delete(table).where(table.c.dataset_name == spec.name, table.c.manifest_version != version)
            )
        return row


def _insert_manifest(connection: Connection, name: str, version: int, manifest: Manifest) -> None:
    for start in range(0, len(manifest), _INSERT_BATCH):
        end = start + _INSERT_BATCH
        batch = zip(manifest.keys[start:end], manifest.sizes[start:end], manifest.etags[start:end])
        if connection.dialect.name == "postgresql":
            # COPY is about 3x faster than multi-row INSERT for 100k-object manifests.
            text = io.StringIO()
            writer = csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n")
            writer.writerows((name, version, key, size, etag) for key, size, etag in batch)
            text.seek(0)
            cursor = connection.connection.cursor()
            try:
                cursor.copy_expert(_COPY_OBJECTS, text)
            finally:
                cursor.close()
        else:
            connection.execute(
                insert(DatasetObject.__table__),
                [
                    {"dataset_name": name, "manifest_version": version, "key": key, "size_bytes": size, "etag": etag}
                    for key, size, etag in batch
                ],
            )


def _load(session: Session, name: str) -> Dataset:
    row = session.get(Dataset, name)
    if row is None:
        raise NotFound(f"no dataset {name!r}", field="name")
    return row


def _check_replacement(row: Dataset, spec: common_pb2.DatasetSpec, replace: bool) -> None:
    if not replace:
        raise _already_exists(spec.name)
    if spec.tenant and spec.tenant != row.tenant:
        raise FailedPrecondition(f"dataset {spec.name!r} is of tenant {row.tenant!r}: a replacement keeps its tenant "
                                 "(leave spec.tenant empty or name that one)", field="spec.tenant")


def _already_exists(name: str) -> AlreadyExists:
    return AlreadyExists(f"dataset {name!r} is already registered; set replace to replace its manifest", field="spec.name")
