"""Initial schema: datasets and manifests, jobs and their events, nodes, plans, metrics, job models.

Timestamps are timezone-aware UTC; SQLite stores them as naive UTC text (see models.UtcDateTime).

Revision ID: 0001
Revises:
Create Date: 2026-11-22 04:57:09.170678
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('datasets',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('storage_options', sa.JSON(), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('manifest_version', sa.BigInteger(), nullable=False),
    sa.Column('num_objects', sa.BigInteger(), nullable=False),
    sa.Column('total_bytes', sa.BigInteger(), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_datasets'))
    )
    op.create_table('jobs',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('client_request_id', sa.String(length=128), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=False),
    sa.Column('application', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.Integer(), nullable=False),
    sa.Column('state', sa.Integer(), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('state_version', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('progress', sa.JSON(), nullable=False),
    sa.Column('allocated', sa.JSON(), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('last_event_sequence', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_jobs')),
    sa.UniqueConstraint('client_request_id', name=op.f('uq_jobs_client_request_id')),
    sa.UniqueConstraint('id', name=op.f('uq_jobs_id'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_application'), ['application'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_tenant'), ['tenant'], unique=False)

    op.create_table('nodes',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('pool', sa.Integer(), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_heartbeat', sa.DateTime(timezone=True), nullable=False),
    sa.Column('applied_plan_version', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_nodes'))
    )
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_nodes_pool'), ['pool'], unique=False)

    op.create_table('plans',
    sa.Column('version', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('policy', sa.String(length=128), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_plans'))
    )
    op.create_table('dataset_objects',
    sa.Column('dataset_name', sa.String(length=128), nullable=False),
    sa.Column('manifest_version', sa.BigInteger(), nullable=False),
    sa.Column('key', sa.String(length=1024).with_variant(sa.String(length=1024, collation='C'), 'postgresql'), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('etag', sa.String(length=256), nullable=False),
    sa.ForeignKeyConstraint(['dataset_name'], ['datasets.name'], name=op.f('fk_dataset_objects_dataset_name_datasets'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('dataset_name', 'manifest_version', 'key', name=op.f('pk_dataset_objects'))
    )
    op.create_table('job_events',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('sequence', sa.BigInteger(), nullable=False),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('type', sa.String(length=64), nullable=False),
    sa.Column('from_state', sa.Integer(), nullable=False),
    sa.Column('to_state', sa.Integer(), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_events_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'sequence', name=op.f('pk_job_events'))
    )
    op.create_table('job_models',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('application', sa.String(length=128), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('observations', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_models_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_job_models'))
    )
    op.create_table('metric_samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Double(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_metric_samples_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_metric_samples'))
    )
    with op.batch_alter_table('metric_samples', schema=None) as batch_op:
        batch_op.create_index('ix_metric_samples_job_id_time', ['job_id', 'time'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('metric_samples', schema=None) as batch_op:
        batch_op.drop_index('ix_metric_samples_job_id_time')

    op.drop_table('metric_samples')
    op.drop_table('job_models')
    op.drop_table('job_events')
    op.drop_table('dataset_objects')
    op.drop_table('plans')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_pool'))

    op.drop_table('nodes')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_tenant'))
        batch_op.drop_index(batch_op.f('ix_jobs_state'))
        batch_op.drop_index(batch_op.f('ix_jobs_kind'))
        batch_op.drop_index(batch_op.f('ix_jobs_application'))

    op.drop_table('jobs')
    op.drop_table('datasets')
