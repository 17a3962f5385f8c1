"""Helpers shared by test suites: real service processes and test servicers."""
