"""Shipped job configs (``*.yaml`` package data): ``nereus configs`` lists them, and
``nereus train NAME`` takes one by its bare name from any directory."""
