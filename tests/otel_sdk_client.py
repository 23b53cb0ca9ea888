#!/usr/bin/env python3
"""Send a few spans to an OTLP/gRPC endpoint with the real OpenTelemetry Python SDK.

Run by `tests/tests/traces_sdk.rs` against `kvfleet traces collect`:

    python3 tests/otel_sdk_client.py --endpoint 127.0.0.1:PORT

Three spans of one trace, shaped like kvfleet's (docs/tracing.md): a root `request` (kind
SERVER), its child `migration`, and the migration's `migration.stage`, with explicit start and
end times and attributes of several types (int, double, string, bool, list of ints). They go
through the SDK's BatchSpanProcessor and the stock `OTLPSpanExporter` (grpc, no TLS, default
compression = none). Prints one JSON object on stdout with what was sent (trace id, span ids,
parents, times) so the test can compare it with the file the sink wrote — the real proof, since
`force_flush` only says the queue was drained in time (a failed export is logged on stderr).
Exits 0 when the flush completed, 1 when it timed out.
Needs `pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc`.
"""

import argparse
import json
import sys

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

T0 = 1_700_000_000_000_000_000  # Unix ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", required=True, help="HOST:PORT of the OTLP/gRPC receiver")
    args = ap.parse_args()

    resource = Resource.create(
        {"service.name": "kvfleet-sdk-test", "service.instance.id": "worker-7", "kvfleet.instance": 7}
    )
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=f"http://{args.endpoint}", insecure=True, timeout=10)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("kvfleet.sdk-test", "0.1")

    sent = {}

    def record(name, span, start, end, parent):
        ctx = span.get_span_context()
        sent[name] = {
            "trace_id": format(ctx.trace_id, "032x"),
            "span_id": format(ctx.span_id, "016x"),
            "parent": None if parent is None else format(parent.get_span_context().span_id, "016x"),
            "start": start,
            "end": end,
        }

    request = tracer.start_span(
        "request",
        kind=trace.SpanKind.SERVER,
        start_time=T0,
        attributes={
            "kvfleet.request.id": 42,
            "kvfleet.request.prompt_tokens": 1000,
            "kvfleet.policy": "pascal",
            "kvfleet.sdk.flag": True,
            "kvfleet.sdk.ints": [1, 2, 3],
        },
    )
    ctx = trace.set_span_in_context(request)
    migration = tracer.start_span(
        "migration",
        context=ctx,
        start_time=T0 + 10_000_000,
        attributes={
            "kvfleet.migration.id": "sdk-1",
            "kvfleet.request.id": 42,
            "kvfleet.link": "7->8",
            "kvfleet.migration.kv_tokens": 4096,
            "kvfleet.migration.outcome": "aborted",
            "kvfleet.migration.downtime_ms": 1.25,
            "kvfleet.migration.total_ms": 20.5,
            "kvfleet.migration.abort_reason": "test, with a comma",
        },
    )
    stage = tracer.start_span(
        "migration.stage",
        context=trace.set_span_in_context(migration),
        start_time=T0 + 11_000_000,
        attributes={"kvfleet.stage.index": 0, "kvfleet.stage.bytes": 1 << 40},
    )
    stage.end(end_time=T0 + 15_000_123)
    migration.end(end_time=T0 + 30_500_000)
    request.end(end_time=T0 + 100_000_000)
    record("request", request, T0, T0 + 100_000_000, None)
    record("migration", migration, T0 + 10_000_000, T0 + 30_500_000, request)
    record("migration.stage", stage, T0 + 11_000_000, T0 + 15_000_123, migration)

    ok = provider.force_flush(timeout_millis=15_000)
    provider.shutdown()
    if not ok:
        print("force_flush did not complete: the export failed or timed out", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(sent))


if __name__ == "__main__":
    main()
