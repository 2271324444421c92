"""The placed attempt: what a job needs (`shape`), and when one of its attempts has
succeeded (`outcome`). Every kind of job — one VM, several VMs, a group of roles — is read
through these, so that launch, probe, finish, late success and cancel agree on it."""
