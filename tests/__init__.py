"""The test suite of rselection."""
