"""This machine's authority and files: certificates, the admin token, accounts, the
install layout, services."""
