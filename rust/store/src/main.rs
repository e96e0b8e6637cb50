fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(elastix_store::main_with_args(std::env::args_os()))
}
