fn main() -> std::process::ExitCode {
    elastix_store::main_with_args(std::env::args_os())
}
