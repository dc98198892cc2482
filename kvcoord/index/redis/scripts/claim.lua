if epoch_changed() then return -2 end
return new_token(ARGV[2])
