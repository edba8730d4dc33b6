# The check_*.py scripts run under the consumers' own interpreters (scripts/interop.sh), not under pytest.
collect_ignore_glob = ["*.py"]
