"""The CI gate: case files run like `kvdiff compare`, JUnit output, and a pytest plugin."""
