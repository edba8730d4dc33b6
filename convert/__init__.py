"""Conversion: command line, planning, Ray orchestration, resume and verification."""
