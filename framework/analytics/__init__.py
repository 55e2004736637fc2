"""The Spark reconciliation and analytics job (`txbox analyze`) and the archiver
(`txbox archive`).

Modules: ``sources`` (service → database URL, JDBC URLs), ``session`` (the Spark
session: local mode or a cluster's master, checked before the JVM starts; Debian's JDBC
jar via ``spark.jars``), ``locations`` (output and history URIs: file://, hdfs://,
s3a://), ``read`` (short JDBC reads split at created_at quantiles + archived history),
``reconcile`` (lost / in flight / stuck / abandoned / unexpected / redelivered),
``stats`` (latency, throughput, attempts, failures, fingerprints, dead-letter trend),
``report`` (tables, Parquet), ``job`` (one run; also a spark-submit script), ``archive``
(old rows to Parquet, a Spark job too; its manifest in ``txbox.archive_batches``).
Nothing here imports pyspark at module import time except inside functions, so
`txbox migrate` never starts a JVM, and both commands check their arguments before theirs.

Running::

    txbox analyze --source order-service=postgresql://postgres@127.0.0.1:5432/orders \
                  --source inventory-service=postgresql://postgres@127.0.0.1:5432/inventory \
                  [--sources-file sources.yml] [--master spark://host:7077] [--every 5m] \
                  [--conf spark.executor.memory=2g] [--parquet URI] [--history URI] [--fail-on-lost]

    # the same job through spark-submit (venv active, so spark-submit finds pyspark):
    spark-submit --master 'local[*]' --driver-memory 2g --jars /usr/share/java/postgresql.jar \
        "$(python -c 'import framework.analytics.job as j; print(j.__file__)')" --source ... --fail-on-lost

    txbox archive --older-than 7d --to s3a://bucket/txbox-archive  # per service (TXBOX_* / --app)

The JDBC driver is Debian's jar given through ``spark.jars`` (``TXBOX_JDBC_JAR`` /
``--jdbc-jar``); nothing is fetched from Maven. The reads are kept short so the job does
not hold a snapshot that bloats the queue tables: see ``read`` (one short statement per
partition of ~100k rows, a bounded window, read-only sessions with a statement timeout).

Exit status: 0, or 1 with ``--fail-on-lost`` when a run found lost messages (cron,
alerting), or 2 on a configuration error (named with its fix, before Spark starts).

Report tables (schema ``txbox``; migration 0005; every table has ``run_id text`` and
``run_at timestamptz``, the run's start). A run is complete when its row exists in
``analytics_runs`` (written last): readers should pick the latest run from there.

``analytics_runs`` — one row per run
    run_id, run_at, finished_at, sources (comma-separated service ids that were judged,
    ``service/tenant`` for each tenant of a service read per tenant),
    window_start (rows created before it were not read, except pending ones),
    grace_seconds, sla_seconds, outbox_rows, inbox_rows (rows read), lost, in_flight,
    stuck, abandoned, unexpected, redelivered (finding counts), notes (newline-separated:
    what could not be judged and why).

``analytics_findings`` — one row per message that needs a look
    kind: ``lost`` (published — outbox processed_at set — more than ``grace`` ago, in
    neither the inbox nor the dead letters of an expected subscriber that is a source),
    ``in_flight`` (same but within the grace period), ``stuck`` (pending past the SLA),
    ``abandoned`` (open dead letter: not replayed, discarded or resolved),
    ``unexpected`` (in an inbox, in no source's outbox), ``redelivered`` (row of
    txbox.redeliveries); service (where the row is, or for lost: the subscriber that
    lacks it); tenant (migration 0012: the tenant of ``service`` the finding concerns —
    for lost, the tenant the message was due at, else its publisher's; null for a service
    read as one database); publisher (lost/in_flight: the outbox's service; unexpected:
    the event's owner from the contracts, or for ``other_tenant`` the outbox's service);
    message_type; message_id (uuid text; null for a dead
    letter without a valid id); state (lost: published; stuck: pending | leased |
    lease_expired | backoff; abandoned: dead-letter source broker | inbox | outbox;
    unexpected: processed | abandoned | pending; redelivered: stored | not_stored);
    reason (lost: not_in_subscriber_inbox; stuck: outbox_pending | inbox_pending;
    abandoned: the dead-letter reason; unexpected: unknown_message_type |
    not_in_publisher_outbox | publisher_not_a_source | no_source_outbox_has_it |
    other_tenant, in the inbox of a tenant other than the one whose outbox has it);
    fingerprint (abandoned); since (lost: published at; stuck: created/received at;
    abandoned: died at; unexpected: received at; redelivered: first seen); age_seconds
    (run_at - since); count (stuck: started attempts; redelivered: redeliveries);
    detail (stuck: attempts and last error; abandoned: dead-letter id and error;
    unexpected/redelivered: queue; other_tenant: the publishing tenant).

The other tables aggregate per service, over every tenant read of it.

``analytics_latency`` — per service, publisher, message_type, stage
    stage: created_published | published_received | received_processed | end_to_end
    (see ``stats``); samples, p50_ms, p90_ms, p99_ms, max_ms, mean_ms. service is where
    the stage ends (the publisher for created_published, else the subscriber);
    publisher is set for created_published and published_received.

``analytics_throughput`` — per service, message_type, event, minute
    event: created | published (outbox) | received | processed (inbox); minute
    (timestamptz, truncated); messages. Only minutes inside the window.

``analytics_attempts`` — distribution of finished_attempts of finished rows
    service, side (outbox | inbox), message_type, attempts, messages.

``analytics_message_types`` — per service, side, message_type
    total, processed, abandoned, pending, attempts (sum of finished_attempts),
    failed_attempts (attempts that did not end in success), failure_rate
    (failed_attempts / attempts), abandon_rate (abandoned / (processed + abandoned)).

``analytics_fingerprints`` — dead letters grouped by failure (top fingerprints)
    service, source, reason, fingerprint, message_type, dead_letters, open,
    first_died_at, last_died_at, sample_error, message_ids (comma-separated, sorted,
    at most TXBOX_ANALYZE_IDS_PER_GROUP).

``analytics_dead_letter_trend`` — service, reason, hour, dead_letters.
"""
