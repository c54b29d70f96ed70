"""What the tests share: synthetic data and indexes, reference searches, ports."""
