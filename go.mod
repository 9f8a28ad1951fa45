module github.com/roce-gather/roce_gather

go 1.26.0

require (
	github.com/ianlancetaylor/cgosymbolizer v0.0.0-20241025222116-6b205f073fdd
	golang.org/x/sys v0.50.0
)

require (
	github.com/stretchr/testify v1.12.1
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
