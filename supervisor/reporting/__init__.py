"""Telling people and systemd how the run goes: console progress and sd_notify."""
