module canaryd.test/faultproxy

go 1.22
