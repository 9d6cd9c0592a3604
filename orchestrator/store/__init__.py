"""The rendezvous store the workers meet at, served by a child process of the driver."""
