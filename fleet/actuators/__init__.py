"""Actuators start, stop and move replicas: on this host (local) or on a Ray cluster."""
