return new_token(ARGV[2])
