"""Payload codecs: each transforms bytes and reports their size; Buffer applies them per call."""
