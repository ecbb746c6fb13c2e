"""Weight sync: the trainer-to-server weight-update group and the bucketed broadcast."""
