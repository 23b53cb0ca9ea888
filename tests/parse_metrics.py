"""Parse Prometheus text files with the official Python client's parser (prometheus_client).

Usage: parse_metrics.py FILE...  Prints {file: {family: type}} as JSON; exits 1 with the parser's
error on a file it cannot parse, 77 when prometheus_client is not installed.
"""
import json
import sys

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:  # the test skips
    print(f"SKIPPED: prometheus_client not importable: {e}", file=sys.stderr)
    sys.exit(77)

out = {}
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        out[path] = {m.name: m.type for m in text_string_to_metric_families(text)}
    except Exception as e:  # noqa: BLE001 - report any parser failure with the file
        print(f"{path}: {e}", file=sys.stderr)
        sys.exit(1)
print(json.dumps(out))
